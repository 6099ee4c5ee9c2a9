"""Fair shares in the claim: which job each claim takes for a given queue and owner counters."""

from __future__ import annotations

from rq import Queue

from protocol import FinishReason, JobStatus, Priority, cancel_job
from protocol.rq_keys import RQKeys
from tests.conftest import enqueue_raw
from tests.worker.jobs.job_support import (
    KEYS,
    expire_lease,
    fake_redis,
    generate,
    make_publisher,
    make_queue,
    make_spec,
    running,
    submit,
)
from worker.jobs.job_scripts import JobScripts
from worker.jobs.stream_publisher import JobEnd

NORMAL = "carpool-tiny-normal"


def _ids(claims: list) -> list[str]:
    return [c.lease.job_id for c in claims]


def _vtimes(redis) -> dict[str, float]:
    return {k.decode(): float(v) for k, v in redis.hgetall(KEYS.fair_vtimes("tiny")).items()}


def _queue_both(redis) -> None:
    """Owner a submitted four jobs, then owner b two (max_tokens 8 each)."""
    submit(redis, "a1", "a2", "a3", "a4", owner="a")
    submit(redis, "b1", "b2", owner="b")


def test_equal_weights_alternate_owners_in_one_claim() -> None:
    redis = fake_redis()
    _queue_both(redis)
    assert _ids(make_queue(redis).claim(6)) == ["a1", "b1", "a2", "b2", "a3", "a4"]
    assert _vtimes(redis) == {"a": 32.0, "b": 16.0}
    assert float(redis.get(KEYS.fair_clock("tiny"))) == 24.0  # a's counter as a4 boarded


def test_weight_two_gets_two_seats_for_each_of_the_other() -> None:
    redis = fake_redis()
    redis.hset(KEYS.fair_weights(), "a", 2)
    _queue_both(redis)
    # a pays 4 per job, b 8: a1(a=4) b1(b=8) a2(a=8, queued before b2) a3(a=12) b2(b=16) a4.
    assert _ids(make_queue(redis).claim(6)) == ["a1", "b1", "a2", "a3", "b2", "a4"]
    assert _vtimes(redis) == {"a": 16.0, "b": 16.0}


def test_counters_are_shared_by_every_worker_of_the_model() -> None:
    redis = fake_redis()
    _queue_both(redis)
    scripts = JobScripts()
    workers = [make_queue(redis, worker=f"w{i}", scripts=scripts) for i in range(3)]
    taken = [_ids(workers[i % 3].claim(1)) for i in range(6)]
    assert taken == [["a1"], ["b1"], ["a2"], ["b2"], ["a3"], ["a4"]]


def test_rq_queue_keeps_the_jobs_not_taken_in_their_order() -> None:
    redis = fake_redis()
    _queue_both(redis)
    make_queue(redis).claim(2)
    assert Queue(NORMAL, connection=redis).get_job_ids() == ["a2", "a3", "a4", "b2"]


def test_priority_tiers_stay_strict_across_owners() -> None:
    redis = fake_redis()
    submit(redis, "a-high-1", "a-high-2", priority=Priority.HIGH, owner="a")
    submit(redis, "b-normal", owner="b")
    submit(redis, "b-low", priority=Priority.LOW, owner="b")
    assert _ids(make_queue(redis).claim(4)) == ["a-high-1", "a-high-2", "b-normal", "b-low"]


def test_an_idle_owner_starts_at_the_clock_and_banks_no_credit() -> None:
    redis = fake_redis()
    # a and b competed for a while; c was idle all along (counter 0).
    redis.hset(KEYS.fair_vtimes("tiny"), mapping={"a": 100, "b": 108})
    redis.set(KEYS.fair_clock("tiny"), 100)
    submit(redis, "a1", "a2", "a3", owner="a")
    submit(redis, "c1", "c2", "c3", owner="c")
    # c counts from 100, not 0: it alternates with a instead of taking all three seats first.
    assert _ids(make_queue(redis).claim(6)) == ["a1", "c1", "a2", "c2", "a3", "c3"]
    assert _vtimes(redis) == {"a": 124.0, "b": 108.0, "c": 124.0}


def test_an_owner_with_the_lower_counter_goes_first_whatever_the_queue_order() -> None:
    redis = fake_redis()
    redis.hset(KEYS.fair_vtimes("tiny"), mapping={"a": 40, "b": 20})
    _queue_both(redis)
    # b is 20 tokens behind a, so it takes both of its jobs' seats before a's 40 catch up.
    assert _ids(make_queue(redis).claim(4)) == ["b1", "b2", "a1", "a2"]


def test_finish_settles_the_charge_to_the_tokens_generated() -> None:
    redis = fake_redis()
    submit(redis, "a1", owner="a")
    queue = make_queue(redis)
    (claim,) = queue.claim(1)
    assert _vtimes(redis) == {"a": 8.0}  # max_tokens, charged at the claim
    job = running(claim)
    generate(job, 5, 6, 7)
    publisher = make_publisher(queue)
    publisher.append(job)
    publisher.finish(job, JobEnd(JobStatus.FINISHED, FinishReason.STOP))
    publisher.flush()
    assert _vtimes(redis) == {"a": 3.0}


def test_settlement_divides_by_the_weight_charged_at_the_claim() -> None:
    redis = fake_redis()
    redis.hset(KEYS.fair_weights(), "a", 4)
    submit(redis, "a1", owner="a")
    queue = make_queue(redis)
    (claim,) = queue.claim(1)
    redis.hset(KEYS.fair_weights(), "a", 1)  # changed meanwhile: the charge made stays
    job = running(claim)
    generate(job, 5, 6)
    publisher = make_publisher(queue)
    publisher.append(job)
    publisher.finish(job, JobEnd(JobStatus.FINISHED, FinishReason.STOP))
    publisher.flush()
    assert _vtimes(redis) == {"a": 0.5}  # 2 tokens / weight 4


def test_a_preempted_job_is_charged_once() -> None:
    redis = fake_redis()
    submit(redis, "a1", owner="a")
    queue = make_queue(redis)
    (claim,) = queue.claim(1)
    publisher = make_publisher(queue)
    publisher.requeue(running(claim), count_as_preemption=True)
    publisher.flush()
    assert _ids(queue.claim(1)) == ["a1"]
    assert _vtimes(redis) == {"a": 8.0}


def test_a_light_key_behind_a_long_burst_boards_at_once() -> None:
    redis = fake_redis()
    submit(redis, *(f"h{i}" for i in range(1, 501)), owner="heavy")
    submit(redis, "l1", owner="light")
    queue = make_queue(redis)
    assert _ids(queue.claim(3)) == ["h1", "l1", "h2"]
    assert Queue(NORMAL, connection=redis).count == 498


def test_the_index_follows_requeue_recovery_and_cancel() -> None:
    redis = fake_redis()
    submit(redis, "a1", "a2", "a3", owner="a")
    queue = make_queue(redis)
    first, second = queue.claim(2)
    publisher = make_publisher(queue)
    publisher.requeue(running(first), count_as_preemption=True)  # back at the front
    publisher.flush()
    expire_lease(redis, "a2")
    publisher.recover()
    publisher.flush()
    owner_list = KEYS.queue_owner_jobs(NORMAL, "a")
    assert redis.lrange(owner_list, 0, -1) == [b"a2", b"a1", b"a3"]
    assert redis.lrange(RQKeys.queue(NORMAL), 0, -1) == [b"a2", b"a1", b"a3"]
    cancel_job(redis, "a1")
    assert redis.lrange(owner_list, 0, -1) == [b"a2", b"a3"]
    assert _ids(queue.claim(3)) == ["a2", "a3"]
    assert redis.llen(owner_list) == 0 and redis.llen(RQKeys.queue(NORMAL)) == 0


def test_stale_index_entries_are_dropped_and_unindexed_jobs_claimed_fifo() -> None:
    redis = fake_redis()
    submit(redis, "a1", "a2", owner="a")
    redis.lrem(RQKeys.queue(NORMAL), 1, "a1")  # taken off its queue outside Carpool's scripts
    redis.hset(KEYS.state("a1"), "status", "canceled")
    enqueue_raw(redis, make_spec("raw").to_dict(), "raw", "tiny", KEYS)  # a plain rq enqueue
    queue = make_queue(redis)
    # a2 is indexed; a1's entry is stale; "raw" is not in the index: FIFO once the index is empty.
    assert _ids(queue.claim(3)) == ["a2", "raw"]
    assert redis.smembers(KEYS.queue_owners(NORMAL)) == set()


def test_an_index_entry_whose_job_left_the_rq_queue_is_skipped() -> None:
    redis = fake_redis()
    submit(redis, "a1", "a2", owner="a")
    redis.lrem(RQKeys.queue(NORMAL), 1, "a1")  # still "queued" in its state, but off the queue
    assert _ids(make_queue(redis).claim(2)) == ["a2"]


def test_owner_list_keys_extend_the_owners_set_key() -> None:
    # Scripts build an owner's list key as the owners set's key + ':' + owner.
    assert KEYS.queue_owner_jobs(NORMAL, "key-1") == KEYS.queue_owners(NORMAL) + ":key-1"


def test_a_job_without_recorded_max_tokens_is_charged_the_default() -> None:
    redis = fake_redis()
    submit(redis, "a1", owner="a")
    redis.hdel(KEYS.state("a1"), "max_tokens")  # as a job enqueued before the field existed
    make_queue(redis).claim(1)
    assert _vtimes(redis) == {"a": 256.0}


def test_the_kv_budget_applies_to_the_fairly_picked_job() -> None:
    redis = fake_redis()
    redis.hset(KEYS.fair_vtimes("tiny"), mapping={"a": 0, "b": 0})
    submit(redis, "a1", owner="a")
    submit(redis, "b1", owner="b")
    redis.hset(KEYS.state("b1"), "prompt_tokens", 40)  # 41 tokens: 3 blocks of 16
    queue = make_queue(redis)
    # a1 (1 block) fits; b1, picked next, needs 3 of the 2 left: the claim stops there.
    assert _ids(queue.claim(2, free_kv_blocks=3)) == ["a1"]
    assert redis.lrange(RQKeys.queue(NORMAL), 0, -1) == [b"b1"]


def test_a_job_adopted_from_an_rq_worker_leaves_its_owner_list() -> None:
    redis = fake_redis()
    submit(redis, "a1", "a2", owner="a")
    redis.lpop(RQKeys.queue(NORMAL))  # an rq worker took a1 (worker.rq_entry), then adopts it
    queue = make_queue(redis)
    assert _ids(queue.claim(0, adopt=("a1", 1))) == ["a1"]
    assert redis.lrange(KEYS.queue_owner_jobs(NORMAL, "a"), 0, -1) == [b"a2"]
    assert _vtimes(redis) == {"a": 8.0}


def test_a_preempted_job_canceled_while_queued_settles_its_charge() -> None:
    redis = fake_redis()
    submit(redis, "a1", owner="a")
    queue = make_queue(redis)
    (claim,) = queue.claim(1)
    job = running(claim)
    generate(job, 5, 6)
    publisher = make_publisher(queue)
    publisher.append(job)
    publisher.requeue(job, count_as_preemption=True)
    publisher.flush()
    assert _vtimes(redis) == {"a": 8.0}
    assert cancel_job(redis, "a1") is JobStatus.CANCELED
    assert _vtimes(redis) == {"a": 2.0}  # the two tokens it generated
