"""Builders for the load generator tests: finished reports, and a fake Carpool API in-process."""

from __future__ import annotations

import json
from dataclasses import dataclass, field

import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route

from loadgen.load_generator import LoadReport, RequestRecord


def make_record(submitted_at: float, token_times: list[float], finished_at: float | None = None,
                max_tokens: int | None = None, error: str = "") -> RequestRecord:
    return RequestRecord(max_tokens=len(token_times) if max_tokens is None else max_tokens,
                         submitted_at=submitted_at, token_times=list(token_times),
                         finished_at=token_times[-1] if finished_at is None else finished_at,
                         finish_reason="length", error=error)


def make_report(label: str, rate: float, records: list[RequestRecord], elapsed_s: float = 10.0,
                **extra: object) -> LoadReport:
    return LoadReport(label=label, rate=rate, records=records, elapsed_s=elapsed_s,
                      slot_utilisation=0.5, preemptions=0, **extra)


@dataclass(slots=True)
class FakeApi:
    """The routes `LoadGenerator` uses, answering like Carpool's API (without a worker).

    A job streams `max_tokens` token events then `done`, except: prompt "no-done" ends its
    stream without the done event; "short" streams one token fewer; "reject" is answered 429.
    Every /metrics scrape adds one 20 ms inter-token gap to the histogram.
    """

    preemptions: int = 0
    metrics_scrapes: int = 0
    bodies: list[dict] = field(default_factory=list)

    def app(self) -> Starlette:
        return Starlette(routes=[
            Route("/v1/jobs", self.submit, methods=["POST"]),
            Route("/v1/jobs/{job_id}/stream", self.stream),
            Route("/v1/stats", self.stats),
            Route("/metrics", self.metrics),
        ])

    async def submit(self, request: Request) -> Response:
        body = await request.json()
        if body["messages"][0]["content"] == "reject":
            return JSONResponse({"detail": "queue full"}, status_code=429)
        self.bodies.append(body)
        self.preemptions += 1
        return JSONResponse({"job_id": f"job{len(self.bodies) - 1}"}, status_code=202)

    async def stream(self, request: Request) -> Response:
        body = self.bodies[int(request.path_params["job_id"].removeprefix("job"))]
        prompt = body["messages"][0]["content"]
        num_tokens = body["max_tokens"] - (prompt == "short")

        async def events():
            for i in range(num_tokens):
                yield f"id: 0-{i + 1}\nevent: token\ndata: {json.dumps({'index': i, 'text': 'x'})}\n\n"
            if prompt != "no-done":
                yield f"id: 0-{num_tokens + 1}\nevent: done\ndata: {json.dumps({'finish_reason': 'length'})}\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    async def stats(self, request: Request) -> Response:
        return JSONResponse({"preemptions": self.preemptions, "workers": [
            {"name": "bench-w", "max_num_seqs": 4, "num_running": 2},
            {"name": "stopped-w", "max_num_seqs": 4, "num_running": 0},
        ]})

    async def metrics(self, request: Request) -> Response:
        self.metrics_scrapes += 1
        gaps = self.metrics_scrapes - 1
        return PlainTextResponse(
            "# TYPE carpool_inter_token_latency_seconds histogram\n"
            f'carpool_inter_token_latency_seconds_bucket{{le="+Inf"}} {gaps}\n'
            f"carpool_inter_token_latency_seconds_sum {0.02 * gaps}\n"
            f"carpool_inter_token_latency_seconds_count {gaps}\n")


@pytest.fixture
def fake_api() -> FakeApi:
    return FakeApi()
