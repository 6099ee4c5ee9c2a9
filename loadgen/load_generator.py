"""Poisson arrivals of streaming clients against the REST API, timed per token."""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field

import httpx
import numpy as np

from loadgen.workload import WorkloadItem


@dataclass(slots=True)
class RequestRecord:
    max_tokens: int
    submitted_at: float = 0.0
    token_times: list[float] = field(default_factory=list)
    finished_at: float = 0.0
    finish_reason: str = ""
    error: str = ""

    @property
    def ttft(self) -> float:
        return self.token_times[0] - self.submitted_at

    @property
    def e2e(self) -> float:
        return self.finished_at - self.submitted_at

    def inter_token_latencies(self) -> list[float]:
        return [b - a for a, b in zip(self.token_times, self.token_times[1:])]


@dataclass(slots=True)
class LoadReport:
    label: str
    rate: float  # requests per second offered; inf = all at once
    records: list[RequestRecord]
    elapsed_s: float
    slot_utilisation: float  # mean over the run, sampled from /v1/stats
    preemptions: int

    @property
    def completed(self) -> list[RequestRecord]:
        return [r for r in self.records if not r.error and r.token_times]

    @property
    def tokens_per_s(self) -> float:
        return sum(len(r.token_times) for r in self.completed) / self.elapsed_s

    @property
    def jobs_per_s(self) -> float:
        return len(self.completed) / self.elapsed_s

    def percentiles(self, values: list[float]) -> tuple[float, float, float]:
        if not values:
            return (float("nan"),) * 3
        p50, p90, p99 = np.percentile(values, [50, 90, 99])
        return float(p50), float(p90), float(p99)

    def summary(self) -> dict[str, object]:
        done = self.completed
        itl = [x for r in done for x in r.inter_token_latencies()]
        return {
            "label": self.label,
            "rate": self.rate,
            "jobs": len(self.records),
            "failed": len(self.records) - len(done),
            "elapsed_s": round(self.elapsed_s, 2),
            "tokens_per_s": round(self.tokens_per_s, 1),
            "jobs_per_s": round(self.jobs_per_s, 2),
            "ttft_p50_p90_p99": [round(x, 3) for x in self.percentiles([r.ttft for r in done])],
            "itl_p50_p90_p99": [round(x, 4) for x in self.percentiles(itl)],
            "e2e_p50_p90_p99": [round(x, 3) for x in self.percentiles([r.e2e for r in done])],
            "slot_utilisation": round(self.slot_utilisation, 3),
            "preemptions": self.preemptions,
        }


class LoadGenerator:
    """Submits each workload item at its Poisson arrival time and reads its SSE stream."""

    def __init__(self, api_url: str, api_key: str | None = None, timeout_s: float = 600.0) -> None:
        self.api_url = api_url.rstrip("/")
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.timeout_s = timeout_s

    async def run(self, label: str, workload: list[WorkloadItem], rate: float, seed: int = 0) -> LoadReport:
        rng = np.random.default_rng(seed)
        gaps = rng.exponential(1.0 / rate, size=len(workload)) if np.isfinite(rate) else np.zeros(len(workload))
        arrivals = np.cumsum(gaps) - gaps[0]
        records = [RequestRecord(max_tokens=item.max_tokens) for item in workload]
        limits = httpx.Limits(max_connections=len(workload) + 8)
        async with httpx.AsyncClient(base_url=self.api_url, headers=self.headers, limits=limits,
                                     timeout=httpx.Timeout(self.timeout_s, connect=10)) as client:
            before = await self._stats(client)
            sampler = asyncio.create_task(self._sample_utilisation(client))
            start = time.perf_counter()
            await asyncio.gather(*(
                self._one(client, item, record, start + float(at))
                for item, record, at in zip(workload, records, arrivals)
            ))
            elapsed = time.perf_counter() - start
            sampler.cancel()
            samples = await asyncio.gather(sampler, return_exceptions=True)
            after = await self._stats(client)
        utilisation = samples[0] if isinstance(samples[0], float) else 0.0
        return LoadReport(label=label, rate=rate, records=records, elapsed_s=elapsed,
                          slot_utilisation=utilisation,
                          preemptions=after.get("preemptions", 0) - before.get("preemptions", 0))

    async def _one(self, client: httpx.AsyncClient, item: WorkloadItem, record: RequestRecord,
                   at: float) -> None:
        await asyncio.sleep(max(0.0, at - time.perf_counter()))
        record.submitted_at = time.perf_counter()
        body = {"messages": item.messages, "max_tokens": item.max_tokens, "temperature": 0.0,
                "ignore_eos": True}
        try:
            response = await client.post("/v1/jobs", json=body)
            if response.status_code != 202:
                record.error = f"{response.status_code}: {response.text[:200]}"
                return
            job_id = response.json()["job_id"]
            async with client.stream("GET", f"/v1/jobs/{job_id}/stream") as stream:
                event = "message"
                async for line in stream.aiter_lines():
                    if line.startswith("event:"):
                        event = line[6:].strip()
                    elif line.startswith("data:"):
                        if event == "done":
                            record.finish_reason = json.loads(line[5:]).get("finish_reason", "")
                            break
                        record.token_times.append(time.perf_counter())
                    elif not line:
                        event = "message"
            record.finished_at = time.perf_counter()
        except httpx.HTTPError as exc:
            record.error = f"{type(exc).__name__}: {exc}"

    async def _stats(self, client: httpx.AsyncClient) -> dict[str, int]:
        response = await client.get("/v1/stats")
        return response.json() if response.status_code == 200 else {}

    async def _sample_utilisation(self, client: httpx.AsyncClient) -> float:
        samples: list[float] = []
        try:
            while True:
                stats = await self._stats(client)
                workers = stats.get("workers", [])
                seats = sum(w["max_num_seqs"] for w in workers)
                if seats:
                    samples.append(sum(w["num_running"] for w in workers) / seats)
                await asyncio.sleep(0.25)
        except asyncio.CancelledError:
            return float(np.mean(samples)) if samples else 0.0
