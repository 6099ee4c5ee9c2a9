"""Token streams on a stream shard: tokens, fencing and the final entry on the shard, the lease,
the cancel flag and the job's records on the main Redis (two fakeredis servers)."""

from __future__ import annotations

import json
import socket
import threading
import time

import fakeredis
import pytest
import redis
from pydantic import ValidationError
from redis.backoff import NoBackoff
from redis.retry import Retry
from rq.registry import CanceledJobRegistry
from rq.serializers import JSONSerializer

from protocol import FinishReason, JobReader, JobStatus, StreamEntry, cancel_job
from protocol.rq_keys import RQKeys
from protocol.stream_shards import placed_shard, shard_urls, started_shard, stream_shard
from protocol.token_runs import expand_runs
from tests.step_notes import notes_of
from tests.worker.jobs.job_support import (
    KEYS,
    expire_lease,
    fake_redis,
    generate,
    make_queue,
    running,
    submit,
)
from worker.jobs.job_queue import JobQueue
from worker.jobs.job_scripts import JobScripts
from worker.jobs.lease import Lease
from worker.jobs.stream_publisher import JobEnd, StreamPublisher
from worker.jobs.stream_shards import StreamShards


def _stream(redis, job_id: str) -> list[tuple[str, StreamEntry]]:
    """The stream as readers see it: one entry per token (runs expanded)."""
    return [(i.decode() if isinstance(i, bytes) else i, StreamEntry.from_fields(f))
            for i, f in expand_runs(redis.xrange(KEYS.stream(job_id)))]


def _worker(main, shard, name: str = "w1", lease_ms: int = 10_000):
    queue = make_queue(main, worker=name, lease_ms=lease_ms)
    shards = StreamShards(main, [shard], queue.scripts, KEYS)  # every stream on the shard
    shards.load_scripts()
    publisher = StreamPublisher(main, queue.scripts, KEYS, name, lease_ms, shards=shards)
    return queue, shards, publisher


def _claim(queue: JobQueue, shards: StreamShards, n: int = 1):
    return [running(claim) for claim in shards.adopt(queue.claim(n), queue.worker_name)]


def _job_1_claimed(main, shard):
    """job-1 submitted and claimed by a worker whose streams are on `shard`: (queue, shards,
    publisher, the running job)."""
    submit(main, "job-1")
    queue, shards, pub = _worker(main, shard)
    (job,) = _claim(queue, shards)
    return queue, shards, pub, job


def _lease(job_id: str, stream_shard: int = -1) -> Lease:
    return Lease(job_id, "1", "q", "e", stream_shard=stream_shard)


def test_a_jobs_shard_is_the_one_its_state_records_else_a_stable_hash_of_its_id() -> None:
    assert shard_urls("redis://main", []) == ["redis://main"]
    assert shard_urls("redis://main", ["redis://a", "redis://b"]) == ["redis://a", "redis://b"]
    assert [stream_shard(f"job-{i}", 3) for i in range(8)] == [1, 2, 0, 0, 2, 0, 0, 1]
    assert stream_shard("job-1", 1) == 0
    assert [placed_shard("job-1", recorded, 3) for recorded in (-1, 0, 1, 2)] == [2, 0, 1, 2]
    assert placed_shard("job-1", 2, 1) == 0
    # From a state: none before any start; the recorded one, or the hash for an unrecorded start.
    assert [started_shard("job-1", recorded, started_at, 3)
            for recorded, started_at in ((-1, 0.0), (1, 0.0), (1, 5.0), (-1, 5.0))] == [
        None, 1, 1, 2]
    main, a, b = fake_redis(), fake_redis(), fake_redis()
    assert StreamShards(main, [], None, KEYS).remote(_lease("job-1")) is None  # type: ignore[arg-type]
    shards = StreamShards(main, [main, a, b], None, KEYS)  # type: ignore[arg-type]
    assert [shards.remote(_lease("job-1", recorded)) for recorded in (-1, 0, 1, 2)] == [
        2, None, 1, 2]


def test_a_worker_takes_its_pinned_shard_or_the_next_in_turn() -> None:
    main, a, b = fake_redis(), fake_redis(), fake_redis()
    assert StreamShards(main, [], None, KEYS).choose_home(-1) is None  # type: ignore[arg-type]
    assert StreamShards(main, [a], None, KEYS).choose_home(-1) is None  # type: ignore[arg-type]
    shards = StreamShards(main, [a, b], None, KEYS)  # type: ignore[arg-type]
    assert [shards.choose_home(-1) for _ in range(5)] == [0, 1, 0, 1, 0]
    assert main.get(KEYS.stream_shard_turns()) == b"5"
    assert shards.choose_home(1) == 1
    assert shards.choose_home(3) == 1


def test_a_job_streams_to_the_shard_of_the_worker_that_first_started_it_for_good() -> None:
    main, shard_0, shard_1 = fake_redis(), fake_redis(), fake_redis()
    for job_id in ("job-1", "job-2"):
        submit(main, job_id)
    workers = {}
    for name, home in (("a", 1), ("b", 0)):
        queue = make_queue(main, worker=name)
        shards = StreamShards(main, [shard_0, shard_1], queue.scripts, KEYS)
        shards.load_scripts()
        queue.home_shard = home
        workers[name] = (queue, shards, StreamPublisher(main, queue.scripts, KEYS, name,
                                                        10_000, shards=shards))
    queue_a, shards_a, pub_a = workers["a"]
    (job_a,) = _claim(queue_a, shards_a)
    assert (job_a.lease.job_id, job_a.lease.stream_shard) == ("job-1", 1)
    assert JobReader(main).state("job-1").stream_shard == 1
    generate(job_a, 11)
    pub_a.append(job_a)
    assert pub_a.flush().refused == set()
    # Worker b (shard 0) starts the next job there, and resumes job-1 on shard 1.
    queue_b, shards_b, pub_b = workers["b"]
    (job_2,) = _claim(queue_b, shards_b)
    assert (job_2.lease.job_id, job_2.lease.stream_shard) == ("job-2", 0)
    expire_lease(main, "job-1")
    pub_b.recover()
    assert pub_b.flush().recovered == ["job-1"]
    (job_b,) = _claim(queue_b, shards_b)
    assert (job_b.lease.job_id, job_b.lease.stream_shard, job_b.token_ids) == ("job-1", 1, [11])
    generate(job_b, 12)
    generate(job_2, 21)
    pub_b.append(job_b)
    pub_b.append(job_2)
    assert pub_b.flush().refused == set()
    assert [e.token_id for _, e in _stream(shard_1, "job-1")] == [11, 12]
    assert [e.token_id for _, e in _stream(shard_0, "job-2")] == [21]
    assert not shard_0.exists(KEYS.stream("job-1")) and not shard_1.exists(KEYS.stream("job-2"))
    assert not main.exists(KEYS.stream("job-1")) and not main.exists(KEYS.stream("job-2"))
    assert JobReader(main).state("job-1").stream_shard == 1


def test_the_shard_list_is_a_comma_separated_setting_for_workers_and_the_api() -> None:
    from api.settings import ApiSettings
    from worker.jobs.settings import WorkerSettings

    urls = " redis://a:6379/0, redis://b:6379/0,"
    assert WorkerSettings(stream_redis_urls=urls).stream_redis_urls == [
        "redis://a:6379/0", "redis://b:6379/0"]
    assert ApiSettings(stream_redis_urls=urls).stream_redis_urls == [
        "redis://a:6379/0", "redis://b:6379/0"]
    assert WorkerSettings().stream_redis_urls == ApiSettings().stream_redis_urls == []
    for settings in (WorkerSettings, ApiSettings):
        with pytest.raises(ValidationError, match="'redis://a:6379/0' and 'redis://a/1' are on "
                                                  "one Redis server"):
            settings(stream_redis_urls="redis://a:6379/0,redis://b,redis://a/1")
    assert WorkerSettings(stream_redis_urls=urls, stream_shard=1).stream_shard == 1
    with pytest.raises(ValidationError, match="stream_shard 2 is not an index into "
                                              r"stream_redis_urls \(2 listed\)"):
        WorkerSettings(stream_redis_urls=urls, stream_shard=2)


def test_tokens_and_the_final_entry_go_to_the_shard_the_records_stay_on_the_main_redis() -> None:
    main, shard = fake_redis(), fake_redis()
    queue, shards, pub, job = _job_1_claimed(main, shard)
    generate(job, 11, 12)
    pub.append(job)
    assert pub.flush().refused == set()
    generate(job, 13)
    pub.append(job)
    pub.finish(job, JobEnd(JobStatus.FINISHED, FinishReason.LENGTH), now=3000.0)
    report = pub.flush()
    assert report.ended == {"job-1": JobStatus.FINISHED}
    assert [(i, e.kind, e.token_id, e.text) for i, e in _stream(shard, "job-1")][:3] == [
        ("0-1", "token", 11, "<11>"), ("0-2", "token", 12, "<12>"), ("0-3", "token", 13, "<13>")]
    done_id, done = _stream(shard, "job-1")[3]
    assert (done_id, done.kind, done.finish_reason, done.prompt_tokens, done.completion_tokens) == (
        "0-4", "done", FinishReason.LENGTH, 3, 3)
    assert main.exists(KEYS.stream("job-1")) == 0
    state = JobReader(main).state("job-1")
    assert (state.status, state.first_token_at, state.prompt_tokens, state.text) == (
        JobStatus.FINISHED, 2000.0, 3, "<11><12><13>")
    assert shard.ttl(KEYS.stream("job-1")) > 0


def test_a_zombie_cannot_append_once_a_new_owner_adopted_and_what_it_wrote_before_is_resumed() -> None:
    main, shard = fake_redis(), fake_redis()
    submit(main, "job-1")
    queue_a, shards_a, pub_a = _worker(main, shard, "a")
    (job_a,) = _claim(queue_a, shards_a)
    generate(job_a, 11)
    pub_a.append(job_a)
    pub_a.flush()
    expire_lease(main, "job-1")
    queue_b, shards_b, pub_b = _worker(main, shard, "b")
    pub_b.recover()
    assert pub_b.flush().recovered == ["job-1"]
    claim_b = queue_b.claim(1)  # claimed on the main Redis, not adopted on the shard yet
    generate(job_a, 12)  # the zombie's last step lands between the two: it is part of the stream
    pub_a.append(job_a)
    pub_a.flush()
    (job_b,) = [running(c) for c in shards_b.adopt(claim_b, "b")]
    assert job_b.token_ids == [11, 12]
    generate(job_a, 13)
    pub_a.append(job_a)
    assert pub_a.flush().refused == {"job-1"}
    generate(job_b, 23)
    pub_b.append(job_b)
    assert pub_b.flush().refused == set()
    assert [e.token_id for _, e in _stream(shard, "job-1")] == [11, 12, 23]


def test_an_old_claim_cannot_lower_the_shards_fence() -> None:
    main, shard = fake_redis(), fake_redis()
    submit(main, "job-1")
    queue_a, shards_a, _ = _worker(main, shard, "a")
    old_claim = queue_a.claim(1)
    expire_lease(main, "job-1")
    queue_b, shards_b, pub_b = _worker(main, shard, "b")
    pub_b.recover()
    pub_b.flush()
    assert len(shards_b.adopt(queue_b.claim(1), queue_b.worker_name)) == 1
    assert shards_a.adopt(old_claim, "a") == []  # its adopt came late: refused, left to lapse


def test_a_cancel_during_the_last_step_ends_the_shards_stream_canceled() -> None:
    main, shard = fake_redis(), fake_redis()
    queue, shards, pub, job = _job_1_claimed(main, shard)
    generate(job, 11)
    pub.append(job)
    pub.flush()
    assert cancel_job(main, "job-1") == JobStatus.RUNNING
    pub.finish(job, JobEnd(JobStatus.FINISHED, FinishReason.STOP))
    assert pub.flush().ended == {"job-1": JobStatus.CANCELED}
    done = _stream(shard, "job-1")[-1][1]
    assert (done.kind, done.finish_reason) == ("done", FinishReason.CANCELED)


def test_a_final_entry_for_a_shard_out_of_reach_is_sent_with_a_later_flush() -> None:
    main = fake_redis()
    shard_server = fakeredis.FakeServer()
    shard = fakeredis.FakeRedis(server=shard_server)
    queue, shards, pub, job = _job_1_claimed(main, shard)
    generate(job, 11)
    pub.append(job)
    pub.flush()
    pub.finish(job, JobEnd(JobStatus.FINISHED, FinishReason.STOP))
    shard_server.connected = False
    # The main Redis records the end; the shard's entry waits (readers see the end in the state).
    assert pub.flush().ended == {"job-1": JobStatus.FINISHED}
    assert not pub.is_empty
    shard_server.connected = True
    pub.flush()
    assert pub.is_empty
    assert [(i, e.kind) for i, e in _stream(shard, "job-1")] == [("0-1", "token"), ("0-2", "done")]


def test_a_shard_restarted_without_its_data_refuses_the_appends_of_its_jobs() -> None:
    main, shard = fake_redis(), fake_redis()
    queue, shards, pub, job = _job_1_claimed(main, shard)
    generate(job, 11)
    pub.append(job)
    pub.flush()
    shard.flushall()
    shard.script_flush()
    generate(job, 12)
    pub.append(job)
    assert pub.flush().refused == {"job-1"}  # its lease lapses, recovery hands it on
    assert shard.exists(KEYS.stream("job-1")) == 0


def test_a_preempted_sharded_job_is_requeued_as_preempted() -> None:
    main, shard = fake_redis(), fake_redis()
    queue, shards, pub, job = _job_1_claimed(main, shard)
    generate(job, 11)
    pub.append(job)
    pub.requeue(job, count_as_preemption=True)
    assert pub.flush().requeued == {"job-1"}
    assert JobReader(main).state("job-1").status == JobStatus.PREEMPTED
    (again,) = _claim(queue, shards)
    assert again.token_ids == [11]


def _notifications(redis) -> list[dict[str, object]]:
    return [{str(k): json.loads(str(v)) if k == "e" else v for k, v in fields.items()}
            for fields in notes_of(redis)]


def test_between_renewals_a_sharded_job_costs_the_main_redis_only_its_cancel_flag() -> None:
    main, shard = fake_redis(), fake_redis()
    submit(main, "job-1", "job-2")
    queue, shards, pub = _worker(main, shard)
    job_1, job_2 = _claim(queue, shards, 2)
    for job in (job_1, job_2):
        generate(job, 11)
        pub.append(job)
    pub.flush()  # renews (the first flush) and records the first tokens: both in the script
    for job in (job_1, job_2):
        job.unpublished.clear()  # published (the worker clears them after each flush)
    sent: list[tuple[object, ...]] = []
    real_call = queue.scripts.call

    def recording_call(target, name, keys, args):
        sent.append((name, *keys))
        return real_call(target, name, keys, args)

    queue.scripts.call = recording_call  # type: ignore[method-assign]
    cancel_job(main, "job-2")
    for job in (job_1, job_2):
        generate(job, 12)
        pub.append(job)
    report = pub.flush()
    # No append script on the main Redis this step: only the shard's, and the flags' SMISMEMBER.
    assert [name for name, *_ in sent] == ["shard_append"]
    assert (report.refused, report.canceled) == (set(), {"job-2"})
    assert [e.token_id for _, e in _stream(shard, "job-1")] == [11, 12]
    # The shard's notifications: each step's tokens, as the hub hands them out.
    assert _notifications(shard) == [
        {"e": [KEYS.stream("job-1"), ["0", "11", "<11>", ""],
               KEYS.stream("job-2"), ["0", "11", "<11>", ""]]},
        {"e": [KEYS.stream("job-1"), ["1", "12", "<12>", ""],
               KEYS.stream("job-2"), ["1", "12", "<12>", ""]]}]
    assert notes_of(main) == []


def test_a_lapsed_sharded_lease_is_noticed_at_the_next_renewal() -> None:
    main, shard = fake_redis(), fake_redis()
    submit(main, "job-1")
    queue, shards, pub = _worker(main, shard, lease_ms=800)  # renewals every 100 ms
    (job,) = _claim(queue, shards)
    generate(job, 11)
    pub.append(job)
    pub.flush()
    job.unpublished.clear()
    expire_lease(main, "job-1")
    time.sleep(0.15)
    generate(job, 12)
    pub.append(job)
    assert pub.flush().refused == {"job-1"}


def test_a_sharded_job_rq_requeued_after_its_end_starts_over_with_a_new_stream() -> None:
    """rq's requeue of an ended job: its old stream goes from its shard before the new run's
    first token, so the stream holds this run only."""
    main, shard = fake_redis(), fake_redis()
    queue, shards, pub, job = _job_1_claimed(main, shard)
    generate(job, 11, 12)
    pub.append(job)
    assert pub.flush().refused == set()
    assert cancel_job(main, "job-1") is JobStatus.RUNNING
    pub.finish(job, JobEnd(JobStatus.CANCELED, FinishReason.CANCELED), now=3000.0)
    assert pub.flush().ended == {"job-1": JobStatus.CANCELED}
    assert [e.kind for _, e in _stream(shard, "job-1")] == ["token", "token", "done"]
    CanceledJobRegistry("carpool-tiny-normal", connection=main,
                        serializer=JSONSerializer).requeue("job-1")
    (again,) = _claim(queue, shards)
    assert again.token_ids == [] and shard.exists(KEYS.stream("job-1")) == 0
    generate(again, 21)
    pub.append(again)
    pub.finish(again, JobEnd(JobStatus.FINISHED, FinishReason.STOP), now=4000.0)
    assert pub.flush().ended == {"job-1": JobStatus.FINISHED}
    assert [(i, e.kind, e.token_id) for i, e in _stream(shard, "job-1")] == [
        ("0-1", "token", 21), ("0-2", "done", -1)]
    assert JobReader(main).state("job-1").token_ids == (21,)


def _two_shard_worker(main, shards_out: list[fakeredis.FakeServer] | None = None):
    """A worker whose own shard is shard 0 of two (fakeredis servers): (queue, shards, publisher,
    the two servers)."""
    servers = [fakeredis.FakeServer(), fakeredis.FakeServer()]
    clients = [fakeredis.FakeRedis(server=server) for server in servers]
    queue = make_queue(main)
    shards = StreamShards(main, clients, queue.scripts, KEYS)
    shards.load_scripts()
    queue.home_shard = shards.choose_home(0)
    publisher = StreamPublisher(main, queue.scripts, KEYS, "w1", 10_000, shards=shards)
    return queue, shards, publisher, servers


def test_a_worker_whose_shard_is_out_starts_jobs_on_the_next_that_answers_then_on_its_own() -> None:
    main = fake_redis()
    _, shards, _, servers = _two_shard_worker(main)
    assert (shards.home, shards.home_for_claims()) == (0, 0)
    servers[0].connected = False
    shards.mark_out(0)  # a call to it failed
    assert shards.home_for_claims() == 1
    servers[1].connected = False
    shards.mark_out(1)
    assert shards.home_for_claims() is None  # none answers: nothing is claimed
    servers[0].connected = servers[1].connected = True
    assert shards.home_for_claims() is None  # looked at again only after a while...
    time.sleep(1.05)  # (0.25-0.5 s after the first look, then 0.5-1 s: Backoff)
    assert shards.home_for_claims() == 0  # ...then back to its own
    assert shards.home == 0
    shards.mark_out(0)  # out, and answering at the next look: back at once
    assert shards.home_for_claims() == 0


def test_a_job_placed_on_a_shard_out_of_reach_goes_back_unplaced_and_starts_on_one_that_answers(
) -> None:
    main = fake_redis()
    queue, shards, pub, servers = _two_shard_worker(main)
    submit(main, "job-1")
    servers[0].connected = False  # not known yet: the claim places the job on shard 0
    (claim,) = queue.claim(1)
    assert (claim.placed_now, JobReader(main).state("job-1").stream_shard) == (True, 0)
    unstarted: list = []
    assert shards.adopt([claim], "w1", unstarted) == []
    assert unstarted == [claim]
    pub.requeue(running(claim), count_as_preemption=False, unplace=True)
    assert pub.flush().requeued == {"job-1"}
    state = JobReader(main).state("job-1")
    assert (state.status, state.stream_shard, state.started_at, state.num_preemptions) == (
        JobStatus.QUEUED, -1, 0.0, 0)
    assert main.lrange(RQKeys.queue(claim.lease.queue_name), 0, -1) == [b"job-1"]  # its front
    # The next claim goes to the shard that answers, and the job streams there.
    queue.home_shard = shards.home_for_claims()
    assert queue.home_shard == 1
    (claim,) = queue.claim(1)
    assert (claim.placed_now, JobReader(main).state("job-1").stream_shard) == (True, 1)
    (job,) = [running(c) for c in shards.adopt([claim], "w1", unstarted)]
    generate(job, 11)
    pub.append(job)
    pub.flush()
    client_1 = fakeredis.FakeRedis(server=servers[1])
    assert [(i, e.token_id) for i, e in _stream(client_1, "job-1")] == [("0-1", 11)]


def test_a_started_job_whose_shard_is_out_of_reach_waits_for_it() -> None:
    # Its stream is there: it is left to recovery (its lease lapses) as before, not unplaced.
    main = fake_redis()
    queue, shards, pub, servers = _two_shard_worker(main)
    submit(main, "job-1")
    (job,) = [running(c) for c in shards.adopt(queue.claim(1), "w1")]
    generate(job, 11)
    pub.append(job)
    pub.flush()
    expire_lease(main, "job-1")
    pub.recover()
    assert pub.flush().recovered == ["job-1"]
    servers[0].connected = False
    (claim,) = queue.claim(1)
    assert not claim.placed_now
    unstarted: list = []
    assert shards.adopt([claim], "w1", unstarted) == []
    assert unstarted == []
    assert JobReader(main).state("job-1").stream_shard == 0


def test_a_shard_that_answers_but_refuses_writes_stays_out(redis_url: str) -> None:
    # At its maxmemory a shard (here the session's real Redis) answers PING but refuses every
    # write: claiming onto it would put each claim back at once, step after step. The look at
    # it is a write.
    main = fake_redis()
    own = redis.Redis.from_url(redis_url)
    shards = StreamShards(main, [own, fake_redis()], None, KEYS)  # type: ignore[arg-type]
    assert shards.choose_home(0) == 0
    policy = own.config_get("maxmemory-policy")["maxmemory-policy"]
    own.config_set("maxmemory-policy", "noeviction")
    own.config_set("maxmemory", 1)
    try:
        shards.mark_out(0)
        assert own.ping()
        assert shards.home_for_claims() == 1
        own.config_set("maxmemory", 0)
        time.sleep(0.55)
        assert shards.home_for_claims() == 0
    finally:
        own.config_set("maxmemory", 0)
        own.config_set("maxmemory-policy", policy)


def _claim_on(queue: JobQueue, shards: StreamShards, job_id: str, shard: int):
    """`job_id` submitted and claimed onto `shard` (the worker's home for that claim)."""
    submit(queue.redis, job_id)
    queue.home_shard = shard
    (job,) = _claim(queue, shards)
    assert JobReader(queue.redis).state(job_id).stream_shard == shard
    return job


def test_final_entries_owed_to_a_shard_out_of_reach_hold_no_flush_up() -> None:
    main = fake_redis()
    queue, shards, pub, servers = _two_shard_worker(main)
    ended = _claim_on(queue, shards, "job-1", 0)
    generate(ended, 11)
    pub.append(ended)
    pub.flush()
    pub.finish(ended, JobEnd(JobStatus.FINISHED, FinishReason.STOP))
    servers[0].connected = False
    other = _claim_on(queue, shards, "job-2", 1)
    generate(other, 12)
    pub.append(other)
    # job-1's end is recorded, its final entry cannot go (kept); job-2's tokens go to shard 1.
    assert pub.flush().ended == {"job-1": JobStatus.FINISHED}
    generate(other, 13)
    pub.append(other)
    assert pub.flush().refused == set()  # before, every flush raised while the entry was owed
    client_0, client_1 = (fakeredis.FakeRedis(server=server) for server in servers)
    assert [e.token_id for _, e in _stream(client_1, "job-2")] == [12, 13]
    servers[0].connected = True
    assert [e.kind for _, e in _stream(client_0, "job-1")] == ["token"]
    pub.flush()  # not looked at again yet: the entry waits...
    assert [e.kind for _, e in _stream(client_0, "job-1")] == ["token"]
    time.sleep(0.55)  # (the next look 0.25-0.5 s after the last: Backoff)
    pub.flush()  # ...until the shard takes a probe
    assert [e.kind for _, e in _stream(client_0, "job-1")] == ["token", "done"]


def test_leaving_a_shard_takes_only_its_jobs_out_of_the_flush() -> None:
    main = fake_redis()
    queue, shards, pub, servers = _two_shard_worker(main)
    lost, kept = _claim_on(queue, shards, "job-1", 0), _claim_on(queue, shards, "job-2", 1)
    for job, token in ((lost, 11), (kept, 21)):
        generate(job, token)
        pub.append(job)
    pub.flush()
    servers[0].connected = False
    generate(lost, 12)
    pub.append(lost)
    pub.finish(lost, JobEnd(JobStatus.FINISHED, FinishReason.STOP))
    generate(kept, 22)
    pub.append(kept)
    with pytest.raises(redis.ConnectionError):
        pub.flush()
    assert pub.unreachable_shard == 0
    assert pub.leave_shard(0) == {"job-1"}
    report = pub.flush()  # the rest goes
    assert (report.ended, report.refused) == ({}, set())
    client_0, client_1 = (fakeredis.FakeRedis(server=server) for server in servers)
    assert [e.token_id for _, e in _stream(client_1, "job-2")] == [21, 22]
    # job-1's end is not recorded: its last token is not in its stream. Its lease lapses, and
    # recovery hands it on once its shard answers.
    assert JobReader(main).state("job-1").status == JobStatus.RUNNING
    servers[0].connected = True
    assert [e.token_id for _, e in _stream(client_0, "job-1")] == [11]


class _SilentShard:
    """A TCP port that takes connections and never answers: a stopped (SIGSTOPped, or cut off)
    shard, as a client meets it. Counts the connections made to it."""

    def __init__(self) -> None:
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.url = f"redis://127.0.0.1:{self._listener.getsockname()[1]}/0"
        self.connections: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                self.connections.append(self._listener.accept()[0])
            except OSError:
                return

    def close(self) -> None:
        self._listener.close()
        for connection in self.connections:
            connection.close()


def test_a_look_at_a_stopped_shard_waits_one_short_timeout_not_the_clients_retries() -> None:
    # The worker's step loop waits for the look: the shard client's retry (worker._redis_client)
    # made it 4 x 0.2 s on two connections.
    silent = _SilentShard()
    try:
        stopped = redis.Redis.from_url(silent.url, socket_timeout=1, socket_connect_timeout=1,
                                       retry=Retry(NoBackoff(), 1))
        main = fake_redis()
        shards = StreamShards(main, [fake_redis(), stopped], JobScripts(), KEYS)
        shards.choose_home(1)
        shards.mark_out(1)
        assert shards.home_for_claims() == 0  # looked at shard 1: no answer
        deadline = time.monotonic() + 5
        while not silent.connections and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(0.2)  # (the port took every connection before the look returned)
        assert len(silent.connections) == 1
    finally:
        silent.close()
