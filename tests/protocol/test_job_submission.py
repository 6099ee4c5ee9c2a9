from __future__ import annotations

import fakeredis
import pytest
from redis.client import Pipeline
from rq import Queue
from rq.job import Job
from rq.job import JobStatus as RQJobStatus
from rq.registry import CanceledJobRegistry
from rq.serializers import JSONSerializer

from protocol import (
    FinishReason,
    JobReader,
    JobStatus,
    Keys,
    Priority,
    StreamEntry,
    cancel_job,
    stream_ids,
    submit_job,
    submit_jobs,
)
from protocol.job_submission import (
    DEFAULT_FAILURE_TTL,
    DEFAULT_RESULT_TTL,
    DuplicateSubmission,
    Idempotency,
    SubmissionCheck,
    SubmissionRefused,
    prepare_submission,
    send_submissions,
)
from protocol.keys import RQ_JOB_FUNCTION
from protocol.rq_keys import RQKeys
from tests.protocol.conftest import make_spec
from tests.step_notes import notes_of

KEYS = Keys()


def test_submit_enqueues_an_rq_json_job_on_its_priority_queue(
        fake_redis: fakeredis.FakeRedis) -> None:
    spec = make_spec("job-1", Priority.HIGH)
    job = submit_job(fake_redis, spec)
    assert job.id == "job-1"
    fetched = Job.fetch("job-1", fake_redis, serializer=JSONSerializer)
    assert fetched.get_status() == RQJobStatus.QUEUED
    assert fetched.func_name == RQ_JOB_FUNCTION
    assert fetched.args == [spec.to_dict()]
    assert fetched.result_ttl == DEFAULT_RESULT_TTL and fetched.failure_ttl == DEFAULT_FAILURE_TTL
    assert fetched.origin == "carpool-tiny-high"
    high = Queue("carpool-tiny-high", connection=fake_redis, serializer=JSONSerializer)
    assert high.job_ids == ["job-1"]
    assert Queue("carpool-tiny-normal", connection=fake_redis).count == 0
    # rq info lists queues from rq:queues
    assert RQKeys.queue("carpool-tiny-high").encode() in fake_redis.smembers(RQKeys.queues_set())


def test_the_rq_job_hash_is_the_one_rq_writes_in_one_hset(fake_redis: fakeredis.FakeRedis) -> None:
    """The script runs the commands rq's own enqueue builds, its two HSETs of the job hash (the
    status, then the whole job) as one."""
    spec = make_spec("job-1", Priority.NORMAL)
    prepared = prepare_submission(fake_redis, [spec])
    flat = [part.decode(errors="replace") if isinstance(part, bytes) else str(part)
            for part in prepared.args]
    job_key = RQKeys.job("job-1")
    hsets_of_the_job = [i for i in range(len(flat) - 1)
                        if flat[i].upper() == "HSET" and flat[i + 1] == job_key]
    assert len(hsets_of_the_job) == 1
    submit_job(fake_redis, spec)
    ours = fake_redis.hgetall(job_key)
    rq_queue = Queue("carpool-tiny-normal", connection=fake_redis, serializer=JSONSerializer)
    rq_queue.enqueue_call(RQ_JOB_FUNCTION, args=[spec.to_dict()], job_id="rq-twin",
                          result_ttl=DEFAULT_RESULT_TTL, failure_ttl=DEFAULT_FAILURE_TTL,
                          timeout=600, description=f"generate {spec.sampling.max_tokens} tokens "
                          f"with {spec.model}")
    theirs = fake_redis.hgetall(RQKeys.job("rq-twin"))
    # Times differ by when each was written; every field and every other value is rq's.
    stamped = {b"created_at", b"enqueued_at"}
    assert set(ours) == set(theirs)
    assert {k: v for k, v in ours.items() if k not in stamped} == \
        {k: v for k, v in theirs.items() if k not in stamped}


def test_submit_writes_the_job_state_and_owner_index(fake_redis: fakeredis.FakeRedis) -> None:
    spec = make_spec("job-2")
    submit_job(fake_redis, spec)
    state = JobReader(fake_redis).state("job-2")
    assert state is not None
    assert (state.status, state.owner, state.model, state.created_at) == (
        JobStatus.QUEUED, "key-1", "tiny", 1000.0)
    assert fake_redis.zrange(KEYS.jobs_by_owner("key-1"), 0, -1, withscores=True) == [
        (b"job-2", 1000.0)]


def test_submit_never_pickles(fake_redis: fakeredis.FakeRedis) -> None:
    submit_job(fake_redis, make_spec("job-3"))
    import zlib
    data = zlib.decompress(fake_redis.hget(RQKeys.job("job-3"), "data"))
    assert data.startswith(b'["worker.rq_entry.generate"')


def test_cancel_a_queued_job_removes_it_and_ends_its_stream(
        fake_redis: fakeredis.FakeRedis) -> None:
    submit_job(fake_redis, make_spec("job-1"))
    submit_job(fake_redis, make_spec("job-2"))
    assert cancel_job(fake_redis, "job-1") is JobStatus.CANCELED
    queue = Queue("carpool-tiny-normal", connection=fake_redis, serializer=JSONSerializer)
    assert queue.job_ids == ["job-2"]
    reader = JobReader(fake_redis)
    read = reader.read("job-1")
    assert read.last_id == "0-1"
    assert read.entries == [StreamEntry(kind="done", finish_reason=FinishReason.CANCELED)]
    state = reader.state("job-1")
    assert state.status is JobStatus.CANCELED and state.finish_reason is FinishReason.CANCELED
    assert state.finished_at > 0
    job = Job.fetch("job-1", fake_redis, serializer=JSONSerializer)
    assert job.get_status() == RQJobStatus.CANCELED
    assert "job-1" in CanceledJobRegistry("carpool-tiny-normal", connection=fake_redis)
    assert not fake_redis.sismember(KEYS.canceled(), "job-1")
    assert 0 < fake_redis.ttl(KEYS.stream("job-1")) <= DEFAULT_RESULT_TTL
    # Stream hubs are told which stream got its final entry (api/stream_hub.py).
    assert notes_of(fake_redis) == [{"k": KEYS.stream("job-1")}]
    # Final: a second cancel changes nothing.
    assert cancel_job(fake_redis, "job-1") is JobStatus.CANCELED
    assert len(reader.read("job-1").entries) == 1


def test_cancel_a_preempted_job_keeps_its_tokens_as_the_partial_result(
        fake_redis: fakeredis.FakeRedis) -> None:
    submit_job(fake_redis, make_spec("job-1"))
    for i, (token_id, text) in enumerate([(11, "a"), (12, "b"), (13, "c")]):
        entry = StreamEntry(kind="token", index=i, token_id=token_id, text=text)
        fake_redis.xadd(KEYS.stream("job-1"), entry.to_fields(), id=stream_ids.token_entry_id(i))
    fake_redis.hset(KEYS.state("job-1"), mapping={"status": "preempted", "prompt_tokens": "5"})
    assert cancel_job(fake_redis, "job-1") is JobStatus.CANCELED
    read = JobReader(fake_redis).read("job-1")
    assert [e.token_id for e in read.tokens] == [11, 12, 13]
    assert read.last_id == "0-4"
    assert read.done == StreamEntry(kind="done", finish_reason=FinishReason.CANCELED,
                                    prompt_tokens=5, completion_tokens=3)
    state = JobReader(fake_redis).state("job-1")
    assert (state.text, state.token_ids, state.completion_tokens) == ("abc", (11, 12, 13), 3)


def test_cancel_a_running_job_only_flags_it(fake_redis: fakeredis.FakeRedis) -> None:
    submit_job(fake_redis, make_spec("job-1"))
    fake_redis.lpop(RQKeys.queue("carpool-tiny-normal"))
    fake_redis.hset(KEYS.state("job-1"), "status", "running")
    assert cancel_job(fake_redis, "job-1") is JobStatus.RUNNING
    assert fake_redis.sismember(KEYS.canceled(), "job-1")
    assert fake_redis.exists(KEYS.stream("job-1")) == 0
    assert notes_of(fake_redis) == []  # nothing written, nothing notified
    assert JobReader(fake_redis).state("job-1").status is JobStatus.RUNNING


def test_cancel_a_job_being_claimed_flags_it_for_the_claimer(
        fake_redis: fakeredis.FakeRedis) -> None:
    submit_job(fake_redis, make_spec("job-1"))
    fake_redis.lpop(RQKeys.queue("carpool-tiny-normal"))  # popped by a worker, not yet claimed
    assert cancel_job(fake_redis, "job-1") is JobStatus.QUEUED
    assert fake_redis.sismember(KEYS.canceled(), "job-1")


@pytest.mark.parametrize("taken_by", ["rq empty", "Job.delete", "Job.cancel"])
def test_cancel_ends_a_queued_job_that_rq_itself_took_off_its_queue(
        fake_redis: fakeredis.FakeRedis, taken_by: str) -> None:
    """rq's own tools remove a queued job no worker will then claim: Carpool's cancel ends it
    (final entry, JobState) instead of flagging it for a claim that never comes."""
    submit_job(fake_redis, make_spec("job-1"))
    submit_job(fake_redis, make_spec("job-2", owner="a"))
    queue = Queue("carpool-tiny-normal", connection=fake_redis, serializer=JSONSerializer)
    rq_job = Job.fetch("job-1", fake_redis, serializer=JSONSerializer)
    if taken_by == "rq empty":
        queue.empty()
    elif taken_by == "Job.delete":
        rq_job.delete()
    else:
        rq_job.cancel()
    assert cancel_job(fake_redis, "job-1") is JobStatus.CANCELED
    read = JobReader(fake_redis).read("job-1")
    assert read.entries == [StreamEntry(kind="done", finish_reason=FinishReason.CANCELED)]
    assert JobReader(fake_redis).state("job-1").status is JobStatus.CANCELED
    assert not fake_redis.sismember(KEYS.canceled(), "job-1")
    assert notes_of(fake_redis) == [{"k": KEYS.stream("job-1")}]
    if taken_by == "Job.cancel":
        assert Job.fetch("job-1", fake_redis).get_status() == RQJobStatus.CANCELED
        assert "job-1" in CanceledJobRegistry("carpool-tiny-normal", connection=fake_redis)
    else:  # a deleted RQ job stays deleted
        assert fake_redis.exists(RQKeys.job("job-1")) == 0
    # Its place in the fair-share index goes too where its queue is known (rq's cancel keeps
    # the RQ job); the other job, on its queue unless emptied, waits in its owner's list.
    owner_list = fake_redis.lrange(KEYS.queue_owner_jobs("carpool-tiny-normal", "key-1"), 0, -1)
    assert owner_list == ([] if taken_by == "Job.cancel" else [b"job-1"])
    assert (JobReader(fake_redis).state("job-2").status, queue.job_ids) == (
        JobStatus.QUEUED, [] if taken_by == "rq empty" else ["job-2"])


def test_cancel_a_finished_job_changes_nothing(fake_redis: fakeredis.FakeRedis) -> None:
    submit_job(fake_redis, make_spec("job-1"))
    fake_redis.hset(KEYS.state("job-1"), "status", "finished")
    assert cancel_job(fake_redis, "job-1") is JobStatus.FINISHED
    assert not fake_redis.sismember(KEYS.canceled(), "job-1")


def test_cancel_an_unknown_job_returns_none(fake_redis: fakeredis.FakeRedis) -> None:
    assert cancel_job(fake_redis, "nope") is None
    assert fake_redis.scard(KEYS.canceled()) == 0


def test_submit_jobs_queues_many_in_one_transaction(fake_redis: fakeredis.FakeRedis) -> None:
    specs = [make_spec(f"job-{i}", Priority.LOW if i % 2 else Priority.NORMAL) for i in range(4)]
    jobs = submit_jobs(fake_redis, specs)
    assert [job.id for job in jobs] == ["job-0", "job-1", "job-2", "job-3"]
    assert Queue("carpool-tiny-normal", connection=fake_redis).job_ids == ["job-0", "job-2"]
    assert Queue("carpool-tiny-low", connection=fake_redis).job_ids == ["job-1", "job-3"]
    assert all(JobReader(fake_redis).state(s.job_id).status is JobStatus.QUEUED for s in specs)


def test_queue_names_are_per_model_and_invertible() -> None:
    assert KEYS.queue_names("a-high") == ["carpool-a-high-high", "carpool-a-high-normal",
                                          "carpool-a-high-low", "carpool-a-high-batch"]
    for model in ("tiny", "a-high", "org/Model-7B"):
        for name in KEYS.queue_names(model):
            assert KEYS.model_of_queue(name) == model
    assert KEYS.model_of_queue("default") is None
    assert KEYS.model_of_queue("carpool--high") is None


def test_submit_writes_what_rqs_own_enqueue_writes(fake_redis: fakeredis.FakeRedis) -> None:
    # The submission script runs the commands rq built: the job hash is rq's, field for field.
    spec = make_spec("job-rq")
    submit_job(fake_redis, spec)
    plain = fakeredis.FakeRedis()
    Queue("carpool-tiny-normal", connection=plain, serializer=JSONSerializer).enqueue_call(
        RQ_JOB_FUNCTION, args=[spec.to_dict()], job_id="job-rq", result_ttl=DEFAULT_RESULT_TTL,
        failure_ttl=DEFAULT_FAILURE_TTL, timeout=600,
        description=f"generate {spec.sampling.max_tokens} tokens with tiny")
    ours, rqs = fake_redis.hgetall(RQKeys.job("job-rq")), plain.hgetall(RQKeys.job("job-rq"))
    clock_fields = {b"created_at", b"enqueued_at", b"last_heartbeat"}
    assert ours.keys() == rqs.keys()
    assert {k: v for k, v in ours.items() if k not in clock_fields} == {
        k: v for k, v in rqs.items() if k not in clock_fields}
    assert fake_redis.lrange(RQKeys.queue("carpool-tiny-normal"), 0, -1) == [b"job-rq"]


def test_a_refused_check_writes_nothing_and_sees_only_its_own_keys_and_args(
        fake_redis: fakeredis.FakeRedis) -> None:
    # The check's KEYS and ARGV are its own (the submission's arguments follow them in the
    # script's ARGV); its verdict comes back whole.
    echo = SubmissionCheck("return {7, #KEYS, #ARGV, tonumber(ARGV[2])}",
                           keys=("k1", "k2"), args=("a", 41, "c"))
    with pytest.raises(SubmissionRefused) as refused:
        submit_jobs(fake_redis, [make_spec("job-x")], check=echo)
    assert refused.value.verdict == [7, 2, 3, 41]
    assert fake_redis.keys() == []
    admit = SubmissionCheck("redis.call('SET', KEYS[1], ARGV[1]) return {1}", keys=("seen",),
                            args=("yes",))
    submit_jobs(fake_redis, [make_spec("job-y")], check=admit)
    assert fake_redis.get("seen") == b"yes"
    assert Queue("carpool-tiny-normal", connection=fake_redis).job_ids == ["job-y"]


def test_submissions_sent_together_end_each_as_if_sent_alone(
        fake_redis: fakeredis.FakeRedis, monkeypatch: pytest.MonkeyPatch) -> None:
    """[redis-cost] send_submissions: several submissions in one request, each queued, refused
    or a duplicate on its own, in order; a script Redis lost is loaded and its submissions sent
    again."""
    first = submit_jobs(fake_redis, [make_spec("job-0")],
                        idempotency=Idempotency("carpool:idem:k", 60))
    assert [job.id for job in first] == ["job-0"]
    refuse = SubmissionCheck("return {0, 5}", keys=(), args=())
    prepared = [
        prepare_submission(fake_redis, [make_spec("job-1")]),
        prepare_submission(fake_redis, [make_spec("job-2")], check=refuse),
        prepare_submission(fake_redis, [make_spec("job-3")],
                           idempotency=Idempotency("carpool:idem:k", 60)),
        prepare_submission(fake_redis, [make_spec("job-4"), make_spec("job-5")]),
    ]
    requests: list[int] = []
    real_execute = Pipeline.execute

    def counting_execute(self, raise_on_error: bool = True):
        requests.append(len(self.command_stack))
        return real_execute(self, raise_on_error)

    monkeypatch.setattr(Pipeline, "execute", counting_execute)
    fake_redis.script_flush()  # as after a Redis restart: the scripts are gone
    outcomes = send_submissions(fake_redis, prepared)
    assert [job.id for job in outcomes[0]] == ["job-1"]
    assert isinstance(outcomes[1], SubmissionRefused) and outcomes[1].verdict == [0, 5]
    assert isinstance(outcomes[2], DuplicateSubmission) and outcomes[2].job_id == "job-0"
    assert [job.id for job in outcomes[3]] == ["job-4", "job-5"]
    # One request for the four, then one more for those whose script was missing (all four).
    assert requests == [4, 4]
    queue = Queue("carpool-tiny-normal", connection=fake_redis, serializer=JSONSerializer)
    assert queue.job_ids == ["job-0", "job-1", "job-4", "job-5"]
    assert fake_redis.exists(RQKeys.job("job-2"), RQKeys.job("job-3")) == 0
    requests.clear()
    outcomes = send_submissions(fake_redis, [prepare_submission(fake_redis, [make_spec("job-6")])])
    assert [job.id for job in outcomes[0]] == ["job-6"] and requests == [1]
