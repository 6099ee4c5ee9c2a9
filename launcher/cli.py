"""`carpool`: one command line for the pieces (api, worker, up, submit, watch, bench).

`carpool up` is the local run: a Redis (started if none answers), the API and one worker on the
bundled model, all stopped by Ctrl-C. The pieces run as child processes, so the API process never
imports torch and each piece is the same program that docker compose runs.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from urllib.parse import urlparse

from launcher.local_redis import DEFAULT_DATA_DIR, LocalRedis, RedisUnavailableError

log = logging.getLogger("carpool")

DEFAULT_REDIS_URL = "redis://127.0.0.1:6379/0"
DEFAULT_API_URL = "http://127.0.0.1:8000"


def main(argv: Sequence[str] | None = None) -> int:
    parser = _parser()
    args, rest = parser.parse_known_args(argv)
    # Plain lines for a newcomer (`up` progress, `submit` answers); the pieces' logs appear with
    # `up --log-level info`, the HTTP requests of `submit`/`watch` with --verbose; bench logs all.
    verbose = args.command == "bench" or getattr(args, "verbose", False) or \
        getattr(args, "log_level", "warning") != "warning"
    level = "INFO" if verbose else "WARNING"
    logging.basicConfig(level=level, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    if args.command in ("api", "worker"):
        # Hand everything after the subcommand to the piece's own parser (`--help` included).
        return subprocess.call([sys.executable, "-m", args.command, *rest])
    if rest:
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    args.argv = list(sys.argv[1:] if argv is None else argv)  # recorded with bench results
    return args.handler(args)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="carpool", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("api", help="run the REST API (python -m api ...)", add_help=False)
    sub.add_parser("worker", help="run a batching worker (python -m worker ...)", add_help=False)

    up = sub.add_parser("up", help="Redis + API + one worker on this machine; Ctrl-C stops all")
    up.add_argument("--model", default="smollm2")
    up.add_argument("--redis-url", default=os.environ.get("CARPOOL_REDIS_URL", DEFAULT_REDIS_URL))
    up.add_argument("--host", default="127.0.0.1")
    up.add_argument("--port", type=int, default=8000)
    up.add_argument("--workers", type=int, default=1, help="worker processes to start")
    up.add_argument("--mode", default="continuous", choices=["continuous", "static", "sequential"])
    up.add_argument("--log-level", default="warning", choices=["debug", "info", "warning", "error"],
                    help="the pieces' log level (default warning: progress lines and the URLs only)")
    up.set_defaults(handler=_up)

    submit = sub.add_parser("submit", help="submit a job to a running API and print its id")
    submit.add_argument("prompt")
    submit.add_argument("--chat", action="store_true", help="send the prompt as a user message")
    submit.add_argument("--max-tokens", type=int, default=64)
    submit.add_argument("--temperature", type=float, default=0.0)
    submit.add_argument("--watch", action="store_true", help="then print its tokens as they come")
    _add_api_options(submit)
    submit.set_defaults(handler=_submit)

    watch = sub.add_parser("watch", help="print a job's token stream as it is generated")
    watch.add_argument("job_id")
    _add_api_options(watch)
    watch.set_defaults(handler=_watch)

    bench = sub.add_parser(
        "bench", help="load-test continuous, static and sequential batching over REST",
        description="Start a private Redis, the API and, for each mode in turn, a worker on MODEL "
        "(all on 127.0.0.1); offer the same Poisson workload at each arrival rate; write "
        "OUT_DIR/bench.json, records.json, bench.md, latency_cdf.png and throughput_vs_rate.png.")
    bench.add_argument("--model", default="smollm2", help="bundled name or local HF directory")
    bench.add_argument("--redis-url", default=None,
                       help="use this Redis (started if none answers) instead of a private one "
                            "on a free port; other workers on it would take bench jobs")
    bench.add_argument("--modes", default="continuous,static,sequential")
    bench.add_argument("--rates", default="1,4",
                       help="arrival rates in jobs/s, comma-separated; inf (or all) = all at once")
    bench.add_argument("--mode-rates", action="append", default=[], metavar="MODE=RATES",
                       help="rates for one mode instead of --rates, e.g. sequential=1,inf "
                            "(repeatable)")
    bench.add_argument("--num-requests", type=int, default=32)
    bench.add_argument("--max-output", type=int, default=128,
                       help="longest output; lengths are long-tailed, generated exactly")
    bench.add_argument("--max-num-seqs", type=int, default=32, help="seats per worker")
    bench.add_argument("--worker-threads", type=int, default=None,
                       help="torch threads per worker (default: torch's choice, all cores)")
    bench.add_argument("--seed", type=int, default=0)
    bench.add_argument("--out-dir", default="bench_out")
    bench.add_argument("--replot", action="store_true",
                       help="offer no load: redraw the table and PNGs in OUT_DIR from its records.json")
    bench.set_defaults(handler=_bench)
    return parser


def _add_api_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--verbose", action="store_true",
                        help="also print the job id, finish reason and usage (to stderr)")
    parser.add_argument("--api-url", default=os.environ.get("CARPOOL_API_URL", DEFAULT_API_URL))
    parser.add_argument("--api-key", default=os.environ.get("CARPOOL_API_KEY"))


def _up(args: argparse.Namespace) -> int:
    try:
        port = urlparse(args.redis_url).port or 6379
        redis = LocalRedis.ensure(args.redis_url, data_dir=DEFAULT_DATA_DIR / str(port))
    except RedisUnavailableError as exc:
        log.error("%s", exc)
        return 1
    _say(f"Redis: {redis.describe()}")
    if _prepare_model(args.model) != 0:
        redis.stop()
        return 1
    children: list[subprocess.Popen] = []
    stopping = False

    def stop(*_: object) -> None:
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGTERM, stop)
    try:
        children.append(subprocess.Popen([
            sys.executable, "-m", "api", "--host", args.host, "--port", str(args.port),
            "--redis-url", args.redis_url, "--log-level", args.log_level,
        ]))
        for index in range(args.workers):
            children.append(subprocess.Popen([
                sys.executable, "-m", "worker", "--model", args.model, "--redis-url",
                args.redis_url, "--mode", args.mode, "--name", f"local-{os.getpid()}-{index}",
                "--log-level", args.log_level,
            ], env=_worker_env(args.log_level)))
        if os.environ.get("CARPOOL_WEBHOOK_SECRET"):
            # Webhooks are on (a signing secret is set): their dispatcher runs beside the API.
            children.append(subprocess.Popen(
                [sys.executable, "-m", "webhooks"],
                env={**os.environ, "CARPOOL_REDIS_URL": args.redis_url,
                     "CARPOOL_LOG_LEVEL": args.log_level}))
        api_url = f"http://{args.host}:{args.port}"
        if _wait_until_ready(api_url, children, lambda: stopping):
            _print_examples(api_url, args.model)
        while not stopping and all(child.poll() is None for child in children):
            time.sleep(0.5)
        failed = [child for child in children if child.poll() not in (None, 0)]
        return 1 if failed else 0
    except KeyboardInterrupt:
        return 0
    finally:
        for child in children:
            if child.poll() is None:
                child.send_signal(signal.SIGTERM)
        for child in children:
            try:
                child.wait(timeout=30)
            except subprocess.TimeoutExpired:
                child.kill()
        redis.stop()
        _say("stopped")


def _worker_env(log_level: str) -> dict[str, str]:
    """A worker's environment under `up`: at the default level without transformers' "Loading
    weights" progress bar, which `up`'s own start-up line stands for (a level below warning, or
    the variable set by the user, keeps it)."""
    env = dict(os.environ)
    if log_level in ("warning", "error"):
        env.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    return env


def _wait_until_ready(api_url: str, children: list[subprocess.Popen], is_stopping) -> bool:
    import httpx

    started = time.monotonic()
    while not is_stopping():
        if any(child.poll() is not None for child in children):
            _end_progress()
            log.error("a child process exited during start-up; see its log above (--log-level info "
                      "shows more)")
            return False
        try:
            health = httpx.get(f"{api_url}/healthz", timeout=1.0).json()
            if health.get("workers", 0) > 0:
                _end_progress()
                return True
        except (httpx.HTTPError, ValueError):
            pass
        _progress("starting the API and the worker (load, CPU kernels, warm-up)", started)
        time.sleep(0.5)
    _end_progress()
    return False


def _say(line: str) -> None:
    print(line, flush=True)


def _progress(what: str, started: float, expected_s: float | None = None) -> None:
    """One self-rewriting status line on a terminal (nothing when the output is a file or pipe)."""
    if not sys.stdout.isatty():
        return
    elapsed = time.monotonic() - started
    if expected_s:
        done = min(1.0, elapsed / expected_s)
        bar = "#" * int(done * 24)
        sys.stdout.write(f"\r{what} [{bar:<24}] {elapsed:4.0f} s ")
    else:
        sys.stdout.write(f"\r{what} ... {elapsed:4.0f} s ")
    sys.stdout.flush()


def _end_progress() -> None:
    if sys.stdout.isatty():
        sys.stdout.write("\n")
        sys.stdout.flush()


def _prepare_model(model: str) -> int:
    """Convert a bundled model once (about a minute) with a progress bar, before the worker starts."""
    started = time.monotonic()
    child = subprocess.Popen([sys.executable, "-m", "worker.model", model],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    while child.poll() is None:
        if time.monotonic() - started > 1.0:  # a cached model is ready at once: no bar
            _progress(f"preparing model {model} (converted once, then cached)", started, 60.0)
        time.sleep(0.25)
    out, err = child.communicate()
    if time.monotonic() - started > 1.0:
        _end_progress()
    if child.returncode != 0:
        log.error("model %s is not usable: %s", model, err.strip() or f"exit {child.returncode}")
        return 1
    _say(f"Model: {model} at {out.strip()}")
    return 0


def _print_examples(api_url: str, model: str) -> None:
    print(f"""
Carpool is up at {api_url}   (API docs: {api_url}/docs, playground: {api_url}/)

  curl -s {api_url}/v1/chat/completions -H 'Content-Type: application/json' \\
    -d '{{"model": "{model}", "messages": [{{"role": "user", "content": "What is 2+2?"}}]}}'

  python -c "from openai import OpenAI; c = OpenAI(base_url='{api_url}/v1', api_key='none'); \\
print(c.chat.completions.create(model='{model}', \\
messages=[{{'role': 'user', 'content': 'What is 2+2?'}}]).choices[0].message.content)"

Ctrl-C stops everything.
""", flush=True)


def _bench(args: argparse.Namespace) -> int:
    import shlex
    from pathlib import Path

    from launcher.bench_run import MODES, BenchConfig, parse_mode_rates, parse_rates, replot, run_bench

    if args.replot:
        try:
            replot(Path(args.out_dir))
        except (OSError, ValueError, KeyError) as exc:
            log.error("cannot replot %s: %s", args.out_dir, exc)
            return 2
        return 0
    modes = tuple(mode.strip() for mode in args.modes.split(",") if mode.strip())
    try:
        unknown = [mode for mode in modes if mode not in MODES]
        if unknown or not modes:
            raise ValueError(f"--modes takes {', '.join(MODES)}; got {args.modes!r}")
        config = BenchConfig(
            model=args.model, redis_url=args.redis_url, modes=modes, rates=parse_rates(args.rates),
            mode_rates=parse_mode_rates(args.mode_rates), num_requests=args.num_requests,
            max_output=args.max_output, max_num_seqs=args.max_num_seqs,
            worker_threads=args.worker_threads, out_dir=Path(args.out_dir), seed=args.seed,
            command=shlex.join(["carpool", *args.argv]),
        )
    except ValueError as exc:
        log.error("%s", exc)
        return 2
    reports = run_bench(config)
    return 0 if all(not r.summary()["failed"] for r in reports) else 1


def _headers(args: argparse.Namespace) -> dict[str, str]:
    return {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}


def _submit(args: argparse.Namespace) -> int:
    import httpx

    body: dict[str, object] = {"max_tokens": args.max_tokens, "temperature": args.temperature}
    if args.chat:
        body["messages"] = [{"role": "user", "content": args.prompt}]
    else:
        body["prompt"] = args.prompt
    try:
        response = httpx.post(f"{args.api_url}/v1/jobs", json=body, headers=_headers(args), timeout=30)
    except httpx.HTTPError as exc:
        print(f"error: cannot reach the API at {args.api_url} ({exc}); is `carpool up` running?",
              file=sys.stderr)
        return 1
    if response.status_code >= 400:
        print(f"error {response.status_code}: {response.text}", file=sys.stderr)
        return 1
    job = response.json()
    if args.verbose:
        print(f"job {job['job_id']}", file=sys.stderr)
    if not args.watch:
        print(job["job_id"], flush=True)
    else:
        args.job_id = job["job_id"]
        return _watch(args)
    return 0


def _watch(args: argparse.Namespace) -> int:
    import httpx

    url = f"{args.api_url}/v1/jobs/{args.job_id}/stream"
    with httpx.stream("GET", url, headers=_headers(args), timeout=None) as response:
        if response.status_code >= 400:
            response.read()
            print(f"error {response.status_code}: {response.text}", file=sys.stderr)
            return 1
        event = "message"
        for line in response.iter_lines():
            if line.startswith("event:"):
                event = line[6:].strip()
            elif line.startswith("data:"):
                data = json.loads(line[5:])
                if event == "done":
                    print(flush=True)  # the answer ends its line; the rest is for --verbose
                    if args.verbose:
                        print(f"[{data.get('finish_reason')}] {json.dumps(data.get('usage', {}))}",
                              file=sys.stderr)
                    if data.get("finish_reason") == "error":
                        print(f"error: {data.get('error')}", file=sys.stderr)
                        return 1
                    return 0
                print(data.get("text", ""), end="", flush=True)
            elif not line:
                event = "message"
    return 0


if __name__ == "__main__":
    sys.exit(main())
