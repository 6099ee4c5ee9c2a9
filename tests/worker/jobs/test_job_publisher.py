"""The publish of one iteration is one round trip; metrics, stats and heartbeats ride along."""

from __future__ import annotations

import json

import pytest
from redis.client import Pipeline
from rq import Worker

from protocol import FinishReason, JobStatus, WorkerStats
from protocol.messages import HISTOGRAM_BUCKETS
from protocol.stream_steps import notified_final
from tests.step_notes import notes_of
from tests.worker.jobs.job_support import (
    KEYS,
    claim_one,
    fake_redis,
    generate,
    make_publisher,
    make_queue,
    running,
    submit,
)
from worker.jobs.rq_presence import RQPresence
from worker.jobs.stream_publisher import JobEnd, StreamPublisher


def test_everything_one_iteration_publishes_is_one_round_trip(
        monkeypatch: pytest.MonkeyPatch) -> None:
    redis = fake_redis()
    submit(redis, "a", "b", "c", "d")
    queue = make_queue(redis, worker="w1")
    a, b, c, d = (running(claim) for claim in queue.claim(4))
    presence = RQPresence(redis, "w1", KEYS.queue_names("tiny"), ttl_seconds=30)
    presence.register_birth()
    pub = StreamPublisher(redis, queue.scripts, KEYS, "w1", queue.lease_ms, presence)
    for job in (a, b, c):
        generate(job, 7)
    for job in (a, b, c, d):
        pub.append(job)
    pub.finish(c, JobEnd(JobStatus.FINISHED, FinishReason.STOP))
    pub.requeue(d, count_as_preemption=True)
    redis.sadd(KEYS.canceled(), "b")
    pub.stats(WorkerStats(name="w1", model="tiny", mode="continuous", num_running=2), 10)
    pub.heartbeat([a.lease, b.lease], execution_ttl_s=120)
    pub.recover()
    pub.observe("inter_token_latency_seconds", 0.02)
    round_trips: list[int] = []
    real_execute = Pipeline.execute

    def counting_execute(self, raise_on_error: bool = True):
        round_trips.append(len(self.command_stack))
        return real_execute(self, raise_on_error)

    monkeypatch.setattr(Pipeline, "execute", counting_execute)
    monkeypatch.setattr(type(redis), "execute_command",
                        lambda *a, **k: pytest.fail(f"a command outside the pipeline: {a[1:]}"))
    report = pub.flush()
    assert len(round_trips) == 1
    assert report.refused == set()
    assert report.canceled == {"b"}
    assert report.ended == {"c": JobStatus.FINISHED}
    assert report.requeued == {"d"}
    assert report.recovered == []
    assert pub.is_empty


def test_histograms_are_cumulative_and_counters_add_up() -> None:
    redis = fake_redis()
    submit(redis, "a")
    queue = make_queue(redis)
    pub = make_publisher(queue)
    for value in (0.004, 0.02, 0.02, 200.0):
        pub.observe("inter_token_latency_seconds", value)
    job = running(queue.claim(1)[0])
    generate(job, 1, 2, 3)
    pub.append(job)
    pub.flush()
    hist = {k.decode(): v.decode() for k, v in
            redis.hgetall(KEYS.histogram("inter_token_latency_seconds")).items()}
    assert hist["0.005"] == "1" and hist["0.01"] == "1" and hist["0.025"] == "3"
    assert hist[str(HISTOGRAM_BUCKETS[-1])] == "3"
    assert (hist["+Inf"], hist["count"]) == ("4", "4")
    assert float(hist["sum"]) == pytest.approx(200.044)
    assert redis.hget(KEYS.counters(), "generated_tokens_total") == b"3"


def test_metrics_add_up_in_the_worker_between_writes_and_lose_nothing() -> None:
    """[redis-cost] With an interval, the flushes in between carry no metric commands; the
    write that comes (on time, or asked for at once) holds every observation and count since."""
    redis = fake_redis()
    submit(redis, "a")
    queue = make_queue(redis)
    pub = StreamPublisher(redis, queue.scripts, KEYS, queue.worker_name, queue.lease_ms,
                          metrics_interval_s=3600)
    job = running(queue.claim(1)[0])
    latency = KEYS.histogram("inter_token_latency_seconds")

    def step(*token_ids: int) -> None:
        generate(job, *token_ids)
        pub.append(job)
        pub.observe("inter_token_latency_seconds", 0.02)
        pub.flush()

    step(1, 2)  # the first flush writes: nothing was written yet
    assert redis.hget(KEYS.counters(), "generated_tokens_total") == b"2"
    step(3)
    step(4)
    assert redis.hget(KEYS.counters(), "generated_tokens_total") == b"2"
    assert redis.hget(latency, "count") == b"1"
    assert not pub.is_empty  # the metrics wait for their write
    pub.write_metrics_now()
    step(5)
    assert redis.hget(KEYS.counters(), "generated_tokens_total") == b"5"
    assert (redis.hget(latency, "count"), redis.hget(latency, "0.025")) == (b"4", b"4")
    assert pub.is_empty
    # The tokens themselves went at every flush: four entries (tokens 1 and 2 as one run).
    assert redis.xlen(KEYS.stream("a")) == 4


@pytest.mark.parametrize("value", ["-5", "abc", "120000"])
def test_a_bad_metrics_interval_is_refused_by_name(value: str, monkeypatch: pytest.MonkeyPatch,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    from worker.__main__ import main as worker_main

    monkeypatch.setenv("CARPOOL_METRICS_INTERVAL_MS", value)
    assert worker_main(["--model", "synthetic"]) == 2  # before any model or Redis is touched
    assert "metrics_interval_ms" in capsys.readouterr().err


def test_the_kv_pool_memory_reaches_the_engine_and_a_bad_one_is_refused_by_name(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    from worker.__main__ import main as worker_main
    from worker.jobs.settings import WorkerSettings

    assert WorkerSettings(model="synthetic").engine_config().kv_cache_memory_gib is None  # sized from the memory
    monkeypatch.setenv("CARPOOL_KV_CACHE_MEMORY_GIB", "12.5")
    assert WorkerSettings(model="synthetic").engine_config().kv_cache_memory_gib == 12.5
    assert worker_main(["--model", "synthetic", "--kv-cache-memory-gib", "0"]) == 2
    assert "kv_cache_memory_gib" in capsys.readouterr().err


def test_stats_expire_and_the_rq_heartbeat_keeps_the_worker_listed() -> None:
    redis = fake_redis()
    queue = make_queue(redis, worker="w1")
    presence = RQPresence(redis, "w1", KEYS.queue_names("tiny"), ttl_seconds=30)
    presence.register_birth()
    pub = StreamPublisher(redis, queue.scripts, KEYS, "w1", queue.lease_ms, presence)
    stats = WorkerStats(name="w1", model="tiny", mode="static", num_kv_blocks_total=8,
                        max_num_seqs=4, updated_at=5.0)
    pub.stats(stats, ttl_seconds=10)
    pub.heartbeat([], execution_ttl_s=120)
    pub.flush()
    assert WorkerStats.from_fields(redis.hgetall(KEYS.worker_stats("w1"))) == stats
    assert 0 < redis.pttl(KEYS.worker_stats("w1")) <= 10_000
    (worker,) = Worker.all(connection=redis)
    assert worker.name == "w1" and worker.queue_names() == KEYS.queue_names("tiny")
    assert 60 < redis.ttl(worker.key) <= 90


def test_scripts_flushed_from_redis_are_loaded_again() -> None:
    redis = fake_redis()
    job, pub = claim_one(redis, "a")
    redis.script_flush()
    generate(job, 5)
    pub.append(job)
    pub.count("jobs_finished_total")
    assert pub.flush().refused == set()
    assert redis.xlen(KEYS.stream("a")) == 1
    assert redis.hget(KEYS.counters(), "jobs_finished_total") == b"1"


def test_an_iteration_is_kept_when_redis_drops_while_its_scripts_are_reloaded(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Redis restarted (no scripts), then dropped again during the reload: nothing of the
    iteration may be forgotten, so the worker's retry of flush() sends it all again."""
    from redis.exceptions import ConnectionError as RedisConnectionError

    from worker.jobs.job_scripts import JobScripts

    redis = fake_redis()
    job, pub = claim_one(redis, "a")
    redis.script_flush()
    generate(job, 5, 6)
    pub.append(job)
    pub.finish(job, JobEnd(JobStatus.FINISHED, FinishReason.LENGTH))
    real_load = JobScripts.load
    failures: list[int] = []

    def load_after_one_failure(self: JobScripts, target: object) -> object:
        if not failures:
            failures.append(1)
            raise RedisConnectionError("Connection closed by server.")
        return real_load(self, target)

    monkeypatch.setattr(JobScripts, "load", load_after_one_failure)
    with pytest.raises(RedisConnectionError):
        pub.flush()
    report = pub.flush()
    assert (report.refused, report.ended) == (set(), {"a": JobStatus.FINISHED})
    # The two tokens went in one publish: one entry, a run (protocol/token_runs.py).
    assert [(i, f[b"kind"]) for i, f in redis.xrange(KEYS.stream("a"))] == [
        (b"0-2", b"tokens"), (b"0-3", b"done")]
    assert pub.is_empty


def _notifications(redis) -> list[dict[str, object]]:
    return [{str(k): json.loads(str(v)) if k in ("e", "f") else v for k, v in fields.items()}
            for fields in notes_of(redis)]


def test_a_step_notifies_its_tokens_only_when_every_one_was_written() -> None:
    redis = fake_redis()
    submit(redis, "a", "b")
    queue = make_queue(redis)
    pub = make_publisher(queue)
    a, b = (running(claim) for claim in queue.claim(2))
    generate(a, 7, 8)
    generate(b, 9)
    pub.append(a)
    pub.append(b)
    pub.flush()
    a.unpublished.clear()
    b.unpublished.clear()
    # Step two: b's lease went to another claim, so b's token is refused; a's is written.
    redis.set(KEYS.lease("b"), "999")
    generate(a, 10)
    generate(b, 11)
    pub.append(a)
    pub.append(b)
    assert pub.flush().refused == {"b"}
    # Step three: a's final entry, carried whole by the finish script's notification (`f`).
    a.unpublished.clear()
    pub.finish(a, JobEnd(JobStatus.FINISHED, FinishReason.STOP))
    pub.flush()
    assert _notifications(redis) == [
        {"e": [KEYS.stream("a"), ["0", "7", "<7>", "", "1", "8", "<8>", ""],
               KEYS.stream("b"), ["0", "9", "<9>", ""]]},
        {"k": KEYS.stream("a")},  # not b's refused token: the hub reads a's stream instead
        {"f": [KEYS.stream("a"), "0-4", "kind", "done", "finish_reason", "stop",
               "prompt_tokens", "3", "completion_tokens", "3", "error", "", "cached_tokens", "0"]}]
    # What the hub hands out is the entry the stream holds.
    final = notified_final(notes_of(redis)[-1])
    done_id, done_fields = redis.xrange(KEYS.stream("a"))[-1]
    assert final == (KEYS.stream("a"), (done_id.decode(), {
        k.decode(): v.decode() for k, v in done_fields.items()}))
    assert [f[b"token_id"] for _, f in redis.xrange(KEYS.stream("b"))] == [b"9"]
