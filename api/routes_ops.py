"""Operating the service: /healthz (also /health and SageMaker's /ping), /version (open),
/metrics (Prometheus) and /v1/stats (JSON)."""

from __future__ import annotations

import logging
from typing import Annotated, Any

import redis.exceptions
from fastapi import APIRouter, Depends
from fastapi.responses import JSONResponse, PlainTextResponse
from pydantic import BaseModel, Field

from api import fleet, metrics
from api.auth import caller_owner
from api.context import AppContext, get_context
from api.version import package_version

log = logging.getLogger(__name__)

open_router = APIRouter(tags=["operations"])
router = APIRouter(tags=["operations"], dependencies=[Depends(caller_owner)])

Context = Annotated[AppContext, Depends(get_context)]


class Health(BaseModel):
    status: str = Field(description="ok (Redis answers, a worker is alive), no_workers (jobs wait "
                                    "in the queue until one starts) or redis_unreachable.")
    redis: bool = Field(description="Whether Redis answered.")
    workers: int = Field(description="Workers that reported in the last few seconds.")
    models: list[str] = Field(description="Models those workers serve.")
    models_without_workers: list[str] = Field(
        default_factory=list, description="Models served here before that no live worker serves "
        "now: their jobs are accepted and wait in their queues until one starts.")


# /health too: the path vLLM's server (and probes written for it) use; /ping is SageMaker's, as
# vLLM and TGI serve it.
@open_router.post("/ping", response_model=Health, summary="Liveness and readiness (SageMaker's path)",
                  responses={503: {"model": Health, "description": "Redis is unreachable."}})
@open_router.get("/ping", response_model=Health, summary="Liveness and readiness (SageMaker's path)",
                 responses={503: {"model": Health, "description": "Redis is unreachable."}})
@open_router.get("/health", response_model=Health, summary="Liveness and readiness (vLLM's path)",
                 responses={503: {"model": Health, "description": "Redis is unreachable."}})
@open_router.get("/healthz", response_model=Health, summary="Liveness and readiness",
                 responses={503: {"model": Health, "description": "Redis is unreachable."}})
async def healthz(ctx: Context) -> JSONResponse:
    try:
        # One round trip (which also shows Redis answers): probes must stay cheap under load.
        workers, known = await fleet.live_workers_and_models(ctx.aio, ctx.keys)
    except redis.exceptions.RedisError as exc:
        # Unreachable, or answering with an error (protected mode's DENIED, LOADING, NOAUTH):
        # either way not ready, and a probe must say so rather than fail with a 500.
        log.warning("healthz: Redis unusable: %s: %s", type(exc).__name__, exc)
        body = Health(status="redis_unreachable", redis=False, workers=0, models=[])
        return JSONResponse(body.model_dump(), status_code=503,
                            headers={"Retry-After": str(ctx.settings.retry_after_s)})
    served = {worker.model for worker in workers}
    body = Health(status="ok" if workers else "no_workers", redis=True, workers=len(workers),
                  models=sorted(served), models_without_workers=sorted(set(known) - served))
    return JSONResponse(body.model_dump())


class Version(BaseModel):
    version: str = Field(description="The installed Carpool package's version.")


@open_router.get("/version", response_model=Version, summary="Carpool's version (vLLM's route)")
async def version() -> Version:
    return Version(version=package_version())


@router.get("/metrics", response_class=PlainTextResponse, summary="Prometheus metrics",
            responses={200: {"content": {"text/plain": {}},
                             "description": "Prometheus text format 0.0.4."}})
async def prometheus_metrics(ctx: Context) -> PlainTextResponse:
    served = [card.name for card in await ctx.models.cards()]
    text = metrics.render(await fleet.snapshot(ctx.aio, ctx.keys), served)
    return PlainTextResponse(text, media_type=metrics.CONTENT_TYPE)


@router.get("/v1/stats", summary="The same numbers as /metrics, as JSON")
async def stats(ctx: Context) -> dict[str, Any]:
    snap = await fleet.snapshot(ctx.aio, ctx.keys)
    counters = {name: int(v) if v.is_integer() else v for name, v in snap.counters.items()}
    return {
        **counters,
        # The short name loadgen reads (loadgen/load_generator.py).
        "preemptions": counters.get("jobs_preempted_total", 0),
        "queue_depth": {priority.value: depth for priority, depth in snap.queue_depths.items()},
        "queue_depth_by_model": {
            model: {priority.value: depth for priority, depth in depths.items()}
            for model, depths in snap.model_queue_depths.items()},
        "jobs": {status.value: count for status, count in snap.jobs_by_status.items()},
        "workers": [
            {field: getattr(worker, field) for field in worker.__dataclass_fields__}
            for worker in snap.workers
        ],
    }
