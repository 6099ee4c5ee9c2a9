"""Poisson arrivals of streaming clients against the REST API, timed per token."""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field

import httpx
import numpy as np

from loadgen.workload import WorkloadItem

ITL_METRIC = "carpool_inter_token_latency_seconds"


def parse_histogram_sum_count(text: str, name: str) -> tuple[float, float] | None:
    """(sum, count) of histogram `name` in Prometheus text format (unlabelled series)."""
    values: dict[str, float] = {}
    for line in text.splitlines():
        parts = line.split()
        if len(parts) == 2 and parts[0] in (f"{name}_sum", f"{name}_count"):
            values[parts[0].rsplit("_", 1)[1]] = float(parts[1])
    if "sum" not in values or "count" not in values:
        return None
    return values["sum"], values["count"]


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

    def to_dict(self, origin: float = 0.0) -> dict[str, object]:
        """Plain data, times in seconds after `origin` (a run's start), to 10 microseconds."""
        def at(t: float) -> float:
            return round(t - origin, 5) if t else 0.0
        return {"max_tokens": self.max_tokens, "submitted_at": at(self.submitted_at),
                "token_times": [at(t) for t in self.token_times], "finished_at": at(self.finished_at),
                "finish_reason": self.finish_reason, "error": self.error}


@dataclass(slots=True)
class LoadReport:
    label: str
    rate: float  # requests per second offered; inf = all at once
    records: list[RequestRecord]
    elapsed_s: float
    slot_utilisation: float  # mean over the run, sampled from /v1/stats
    preemptions: int
    # Mean gap between a job's tokens as the worker publishes them (from /metrics): the rest of
    # the client-side inter-token latency is the API, SSE and client path. None: not measured.
    worker_itl_mean_s: float | None = None

    @property
    def completed(self) -> list[RequestRecord]:
        return [r for r in self.records if not r.error and r.token_times]

    @property
    def tokens_per_s(self) -> float:
        return sum(len(r.token_times) for r in self.completed) / self.elapsed_s

    @property
    def offered_tokens_per_s(self) -> float:
        """What the clients ask for: arrival rate times the mean output length (inf: a burst)."""
        return self.rate * float(np.mean([r.max_tokens for r in self.records])) if self.records else 0.0

    @property
    def jobs_per_s(self) -> float:
        return len(self.completed) / self.elapsed_s

    def inter_token_latencies(self) -> list[float]:
        return [x for r in self.completed for x in r.inter_token_latencies()]

    def to_dict(self) -> dict[str, object]:
        """Everything the summary and the plots are made from (`from_dict` reads it back)."""
        origin = min((r.submitted_at for r in self.records), default=0.0)
        return {"label": self.label, "rate": "inf" if np.isinf(self.rate) else self.rate,
                "elapsed_s": self.elapsed_s, "slot_utilisation": self.slot_utilisation,
                "preemptions": self.preemptions, "worker_itl_mean_s": self.worker_itl_mean_s,
                "records": [r.to_dict(origin) for r in self.records]}

    @classmethod
    def from_dict(cls, data: dict) -> LoadReport:
        return cls(label=data["label"], rate=float(data["rate"]),
                   records=[RequestRecord(**record) for record in data["records"]],
                   elapsed_s=data["elapsed_s"], slot_utilisation=data["slot_utilisation"],
                   preemptions=data["preemptions"], worker_itl_mean_s=data["worker_itl_mean_s"])

    def percentiles(self, values: list[float]) -> tuple[float, float, float]:
        if not values:
            return (float("nan"),) * 3
        p50, p90, p99 = np.percentile(values, [50, 90, 99])
        return float(p50), float(p90), float(p99)

    def summary(self) -> dict[str, object]:
        done = self.completed
        itl = self.inter_token_latencies()
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
            "itl_mean_client_s": round(float(np.mean(itl)), 4) if itl else None,
            "itl_mean_worker_s": (round(self.worker_itl_mean_s, 4)
                                  if self.worker_itl_mean_s is not None else None),
            "e2e_p50_p90_p99": [round(x, 3) for x in self.percentiles([r.e2e for r in done])],
            "slot_utilisation": round(self.slot_utilisation, 3),
            "preemptions": self.preemptions,
        }


def poisson_arrivals(count: int, rate: float, seed: int) -> list[float]:
    """When each of `count` jobs is offered, in seconds from the first: Poisson arrivals at
    `rate` jobs/s (exponential gaps from `seed`), or all at 0 for an infinite rate."""
    if not np.isfinite(rate):
        return [0.0] * count
    gaps = np.random.default_rng(seed).exponential(1.0 / rate, size=count)
    return [float(at) for at in np.cumsum(gaps) - gaps[0]]


class LoadGenerator:
    """Submits each workload item at its Poisson arrival time and reads its SSE stream."""

    def __init__(self, api_url: str, api_key: str | None = None, timeout_s: float = 600.0,
                 transport: httpx.AsyncBaseTransport | None = None) -> None:
        self.api_url = api_url.rstrip("/")
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.timeout_s = timeout_s
        self.transport = transport  # tests: an in-process app instead of the network

    async def run(self, label: str, workload: list[WorkloadItem], rate: float, seed: int = 0,
                  worker_name: str | None = None) -> LoadReport:
        """Offer `workload` at `rate` jobs/s (Poisson; inf = all at once) and time every token.

        `worker_name` restricts the slot-utilisation samples to that worker: a worker that just
        stopped keeps its stats hash for a few seconds and would otherwise count as idle seats.
        """
        arrivals = poisson_arrivals(len(workload), rate, seed)
        records = [RequestRecord(max_tokens=item.max_tokens) for item in workload]
        limits = httpx.Limits(max_connections=len(workload) + 8)
        async with httpx.AsyncClient(base_url=self.api_url, headers=self.headers, limits=limits,
                                     timeout=httpx.Timeout(self.timeout_s, connect=10),
                                     transport=self.transport) as client:
            before = await self._stats(client)
            itl_before = await self._histogram_sum_count(client, ITL_METRIC)
            sampler = asyncio.create_task(self._sample_utilisation(client, worker_name))
            start = time.perf_counter()
            await asyncio.gather(*(
                self._one(client, item, record, start + at)
                for item, record, at in zip(workload, records, arrivals)
            ))
            elapsed = time.perf_counter() - start
            sampler.cancel()
            samples = await asyncio.gather(sampler, return_exceptions=True)
            after = await self._stats(client)
            itl_after = await self._histogram_sum_count(client, ITL_METRIC)
        utilisation = samples[0] if isinstance(samples[0], float) else 0.0
        worker_itl = None
        if itl_before is not None and itl_after is not None and itl_after[1] > itl_before[1]:
            worker_itl = (itl_after[0] - itl_before[0]) / (itl_after[1] - itl_before[1])
        return LoadReport(label=label, rate=rate, records=records, elapsed_s=elapsed,
                          slot_utilisation=utilisation,
                          preemptions=after.get("preemptions", 0) - before.get("preemptions", 0),
                          worker_itl_mean_s=worker_itl)

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
            if not record.finish_reason:
                record.error = f"stream of job {job_id} ended without its done event"
            elif len(record.token_times) != item.max_tokens:
                # ignore_eos: every job must generate exactly max_tokens, or the modes did
                # different work and their figures are not comparable.
                record.error = (f"job {job_id} streamed {len(record.token_times)} tokens, "
                                f"not {item.max_tokens} ({record.finish_reason})")
        except httpx.HTTPError as exc:
            record.error = f"{type(exc).__name__}: {exc}"

    async def _stats(self, client: httpx.AsyncClient) -> dict[str, int]:
        response = await client.get("/v1/stats")
        return response.json() if response.status_code == 200 else {}

    async def _histogram_sum_count(self, client: httpx.AsyncClient,
                                   name: str) -> tuple[float, float] | None:
        """(sum, count) of a Prometheus histogram on /metrics; None if it is not there."""
        response = await client.get("/metrics")
        if response.status_code != 200:
            return None
        return parse_histogram_sum_count(response.text, name)

    async def _sample_utilisation(self, client: httpx.AsyncClient, worker_name: str | None) -> float:
        samples: list[float] = []
        try:
            while True:
                stats = await self._stats(client)
                workers = [w for w in stats.get("workers", [])
                           if worker_name is None or w.get("name") == worker_name]
                seats = sum(w["max_num_seqs"] for w in workers)
                if seats:
                    samples.append(sum(w["num_running"] for w in workers) / seats)
                await asyncio.sleep(0.25)
        except asyncio.CancelledError:
            return float(np.mean(samples)) if samples else 0.0
