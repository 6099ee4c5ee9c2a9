"""`python -m worker --model smollm2 --redis-url redis://...`: one batching worker process.

Flags override CARPOOL_* environment variables (WorkerSettings). Exit status 0 after a drain
(SIGTERM/SIGINT), 2 for bad settings, 1 when the model or Redis cannot be reached at start.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Sequence

from pydantic import ValidationError

from protocol.redis_urls import shown_url


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m worker", description=__doc__.splitlines()[0])
    add = parser.add_argument
    add("--model", help="bundled model name (smollm2) or a local Hugging Face directory")
    add("--served-model-name", help="the model name jobs use (default: --model, or its dir name)")
    add("--redis-url")
    add("--stream-redis-urls", help="stream shards, comma-separated (default: --redis-url)")
    add("--stream-shard", type=int,
        help="this worker's stream shard, an index into --stream-redis-urls: the jobs it starts "
             "stream there (default: the next in turn over the fleet's worker starts)")
    add("--name", help="worker name (rq info, stats); default host-pid-random")
    add("--mode", choices=["continuous", "static", "sequential"])
    add("--max-num-seqs", type=int)
    add("--max-num-batched-tokens", type=int)
    add("--num-kv-blocks", type=int)
    add("--kv-cache-memory-gib", type=float,
        help="GiB the KV pool may take when --num-kv-blocks is unset (default: a quarter of the "
             "memory available on a CPU, at least 2 where half of it allows; 2 on a GPU)")
    add("--block-size", type=int)
    add("--max-model-len", type=int)
    add("--dtype")
    add("--device")
    add("--num-threads", type=int)
    add("--logprobs-mode", choices=["raw_logprobs", "processed_logprobs"],
        help="what generated tokens' logprobs are of: the model's own distribution (default, as "
             "vLLM's) or the processed one at the request's temperature")
    add("--lease-seconds", type=float)
    add("--drain-seconds", type=float)
    add("--idle-block-seconds", type=float)
    add("--stream-interval-ms", type=float,
        help="least time between two publishes of the batch's tokens (default 0: every step)")
    add("--metrics-interval-ms", type=float,
        help="least time between two writes of the metric counters and histograms (default 1000)")
    add("--keys-prefix")
    add("--log-level")
    add("--openmp", choices=["intel", "gnu"], help="OpenMP runtime of the model's CPU threads")
    add("--allocator", choices=["tcmalloc", "system"],
        help="memory allocator (default tcmalloc, where installed)")
    return parser


def main(argv: Sequence[str] | None = None, reexec: bool = False) -> int:
    """`reexec`: allowed to replace this process (the command line), to preload its allocator
    and OpenMP runtime."""
    args = _parser().parse_args(argv)
    overrides = {name: value for name, value in vars(args).items() if value is not None}
    from worker.jobs.settings import WorkerSettings

    try:
        settings = WorkerSettings(**overrides)
    except (ValidationError, ValueError) as exc:
        print(f"invalid worker settings: {exc}", file=sys.stderr)
        return 2
    if reexec:
        from worker.model import process_preloads as preloads

        libraries = preloads.wanted_libraries(settings.allocator, settings.openmp,
                                              preloads.tcmalloc_library(),
                                              preloads.intel_openmp_library())
        env = preloads.preload_environment(os.environ, libraries)
        if env is not None:  # before torch is imported: the libraries must be there at start
            os.execve(sys.executable, [sys.executable, "-m", "worker", *sys.argv[1:]], env)
    logging.basicConfig(level=settings.log_level.upper(),
                        format=f"%(asctime)s {settings.name} %(name)s %(levelname)s %(message)s")
    from redis import Redis
    from redis.backoff import NoBackoff
    from redis.exceptions import ConnectionError as RedisConnectionError
    from redis.retry import Retry

    from worker.engine.engine import Engine
    from worker.jobs.batching_worker import BatchingWorker
    from worker.model.loader import ModelLoadError

    redis = Redis.from_url(settings.redis_url, socket_timeout=settings.redis_timeout_seconds
                           + settings.idle_block_seconds,
                           socket_connect_timeout=settings.redis_timeout_seconds,
                           health_check_interval=30,
                           # One quiet retry on a fresh connection (a pooled one may predate a
                           # Redis restart); beyond that the worker backs off and logs itself.
                           retry=Retry(NoBackoff(), 1))
    try:
        redis.ping()
    except RedisConnectionError as exc:
        logging.error("cannot reach Redis at %s: %s", shown_url(settings.redis_url), exc)
        return 1
    try:
        engine = Engine(settings.engine_config())
    except ModelLoadError as exc:
        logging.error("%s", exc)
        return 1
    except ValueError as exc:  # settings the model or this machine cannot take (the KV pool's)
        logging.error("invalid worker settings: %s", exc)
        return 2
    worker = BatchingWorker(settings, engine, redis)
    worker.install_signal_handlers()
    return worker.run()


if __name__ == "__main__":
    sys.exit(main(reexec=True))
