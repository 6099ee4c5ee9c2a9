"""What the workers report through Redis: live WorkerStats, counters, histograms, RQ registries.

Read-only, and a handful of commands per call, so /healthz and /metrics stay cheap to scrape.
"""

from __future__ import annotations

from dataclasses import dataclass

import redis.asyncio as aioredis

from protocol import JobStatus, Keys, Priority, WorkerStats
from protocol.messages import HISTOGRAMS
from protocol.rq_keys import RQKeys

# RQ's registries, which Carpool workers maintain as an RQ worker would, count jobs by status.
_REGISTRY_BY_STATUS = {
    JobStatus.RUNNING: RQKeys.started,
    JobStatus.FINISHED: RQKeys.finished,
    JobStatus.FAILED: RQKeys.failed,
    JobStatus.CANCELED: RQKeys.canceled,
}


# Counters every scrape shows, at 0 before any worker has counted one (a dashboard needs the
# series); the names are the fields workers HINCRBY (worker/stream_publisher.py).
DEFAULT_COUNTERS = ("generated_tokens_total", "prompt_tokens_total", "jobs_preempted_total")


@dataclass(frozen=True, slots=True)
class FleetSnapshot:
    queue_depths: dict[Priority, int]  # over every model
    model_queue_depths: dict[str, dict[Priority, int]]  # per model ever registered
    jobs_by_status: dict[JobStatus, int]
    workers: list[WorkerStats]
    counters: dict[str, float]
    histograms: dict[str, dict[str, str]]  # name -> the raw hash fields


# One round trip however many workers there are: RQ's worker registry (every Carpool worker
# registers there under its own name), then each member's stats hash, and the names of the models
# ever registered. KEYS: the registry, the models hash. ARGV: the members' prefix (rq:worker:),
# then the prefix and suffix of a stats key around the name.
_LIVE_WORKERS_LUA = """
local found = {}
for _, member in ipairs(redis.call('SMEMBERS', KEYS[1])) do
  local name = string.sub(member, #ARGV[1] + 1)
  local fields = redis.call('HGETALL', ARGV[2] .. name .. ARGV[3])
  if #fields > 0 then found[#found + 1] = fields end
end
return {found, redis.call('HKEYS', KEYS[2])}
"""


async def live_workers_and_models(redis: aioredis.Redis, keys: Keys
                                  ) -> tuple[list[WorkerStats], list[str]]:
    """Workers whose TTL'd stats hash still exists, i.e. that reported recently, and every model
    ever registered (sorted), in one round trip.

    A registered worker without stats died without unregistering (SIGKILL) or is not a Carpool
    worker. (A SCAN for the stats keys walked the whole keyspace, every job's keys, at each
    /healthz: tens of round trips once a few thousand jobs were kept.)
    """
    stats_prefix, _, stats_suffix = keys.worker_stats("\x00").partition("\x00")
    script = redis.register_script(_LIVE_WORKERS_LUA)
    replies, models = await script(keys=[RQKeys.workers_set(), keys.models()],
                                   args=[RQKeys.worker(""), stats_prefix, stats_suffix])
    workers = [WorkerStats.from_fields(dict(zip(fields[::2], fields[1::2])))
               for fields in replies]
    return sorted(workers, key=lambda worker: worker.name), sorted(_text(m) for m in models)


async def live_workers(redis: aioredis.Redis, keys: Keys) -> list[WorkerStats]:
    """Workers that reported recently (see live_workers_and_models)."""
    workers, _ = await live_workers_and_models(redis, keys)
    return workers


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


async def known_models(redis: aioredis.Redis, keys: Keys) -> list[str]:
    """Every model ever registered here (`Keys.models`), live or not, sorted."""
    return sorted(_text(name) for name in await redis.hkeys(keys.models()))


async def snapshot(redis: aioredis.Redis, keys: Keys) -> FleetSnapshot:
    models = await known_models(redis, keys)
    queue_names = [(model, priority, keys.queue_name(model, priority))
                   for model in models for priority in Priority.ordered()]
    async with redis.pipeline(transaction=False) as pipe:
        for _, _, name in queue_names:
            pipe.llen(RQKeys.queue(name))
        for registry in _REGISTRY_BY_STATUS.values():
            for _, _, name in queue_names:
                pipe.zcard(registry(name))
        pipe.hgetall(keys.counters())
        for histogram in HISTOGRAMS:
            pipe.hgetall(keys.histogram(histogram))
        replies = await pipe.execute()
    num_queues = len(queue_names)
    depths = {priority: 0 for priority in Priority.ordered()}
    model_depths: dict[str, dict[Priority, int]] = {model: {} for model in models}
    for (model, priority, _), depth in zip(queue_names, replies[:num_queues]):
        depths[priority] += depth
        model_depths[model][priority] = depth
    jobs = {JobStatus.QUEUED: sum(depths.values())}
    for i, status in enumerate(_REGISTRY_BY_STATUS):
        start = num_queues * (i + 1)
        jobs[status] = sum(replies[start:start + num_queues])
    rest = replies[num_queues * (len(_REGISTRY_BY_STATUS) + 1):]
    counters = {name: 0.0 for name in DEFAULT_COUNTERS}
    counters.update({name: float(value) for name, value in rest[0].items()})
    histograms = dict(zip(HISTOGRAMS, rest[1:]))
    return FleetSnapshot(queue_depths=depths, model_queue_depths=model_depths,
                         jobs_by_status=jobs, workers=await live_workers(redis, keys),
                         counters=counters, histograms=histograms)
