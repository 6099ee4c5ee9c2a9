"""Two real workers on one set of queues: sharing, bad jobs, fencing a paused worker, SIGKILL."""

from __future__ import annotations

import signal
import subprocess
import sys
import time

import pytest
from rq import Queue, Worker
from rq.command import send_shutdown_command, send_stop_job_command
from rq.job import Job
from rq.job import JobStatus as RQJobStatus
from rq.registry import FailedJobRegistry, FinishedJobRegistry
from rq.serializers import JSONSerializer

from protocol import (
    FinishReason,
    JobReader,
    JobSpec,
    JobStatus,
    ModelCard,
    Priority,
    TokenEntry,
    submit_jobs,
)
from protocol.keys import RQ_JOB_FUNCTION
from protocol.rq_keys import RQKeys
from tests.conftest import enqueue_raw
from tests.integration.conftest import (
    KEYS,
    Fleet,
    assert_stream_exact,
    expected_tokens,
    make_specs,
    new_id,
    wait_final,
    wait_until,
)
from worker.jobs.job_queue import JobQueue
from worker.jobs.job_scripts import JobScripts
from worker.jobs.running_job import RunningJob
from worker.jobs.stream_publisher import JobEnd, StreamPublisher

pytestmark = pytest.mark.slow

PAIR_ARGS = ["--max-num-seqs", "4", "--lease-seconds", "3", "--idle-block-seconds", "0.5",
             "--num-threads", "1"]


def _normal(fleet: Fleet) -> str:
    """The tiny model's normal-priority queue."""
    return KEYS.queue_name(fleet.model_dir.name, Priority.NORMAL)


@pytest.fixture(scope="module")
def pair(fleet: Fleet) -> Fleet:
    fleet.start(("alpha", PAIR_ARGS), ("beta", PAIR_ARGS))
    return fleet


def test_workers_show_in_rq_info_and_publish_their_model(pair: Fleet) -> None:
    workers = {w.name: w for w in Worker.all(connection=pair.redis)}
    assert set(workers) == {"alpha", "beta"}
    model = pair.model_dir.name
    assert workers["alpha"].queue_names() == [
        f"carpool-{model}-high", f"carpool-{model}-normal", f"carpool-{model}-low",
        f"carpool-{model}-batch"]
    info = subprocess.run([sys.executable, "-m", "rq.cli", "info", "--url", pair.redis_url],
                          capture_output=True, text=True, timeout=60)
    assert "alpha" in info.stdout and "beta" in info.stdout, info.stdout + info.stderr
    card = ModelCard.from_json(pair.redis.hget(KEYS.models(), pair.model_dir.name))
    assert card.name == pair.model_dir.name and card.max_model_len == 1024
    assert card.vocab_size == 49152  # the API checks logit_bias and stop_token_ids against it
    assert card.eos_token == "<|im_end|>" and "im_start" in card.chat_template
    tokenizer = pair.redis.get(KEYS.model_tokenizer(card.name))
    assert tokenizer == (pair.model_dir / "tokenizer.json").read_bytes()


def test_two_workers_share_one_queue_and_run_every_job_once(
        pair: Fleet, reference_engine: object) -> None:
    specs = make_specs(pair.model_dir.name, 12, max_tokens=24)
    expected = expected_tokens(reference_engine, specs)
    submit_jobs(pair.redis, specs)
    states = wait_final(pair, [s.job_id for s in specs])
    assert {s.worker for s in states.values()} == {"alpha", "beta"}
    for spec in specs:
        state = states[spec.job_id]
        assert state.status is JobStatus.FINISHED
        assert list(state.token_ids) == expected[spec.job_id]
        assert_stream_exact(pair.redis, spec.job_id, expected[spec.job_id])
        job = Job.fetch(spec.job_id, pair.redis, serializer=JSONSerializer)
        assert job.get_status() == RQJobStatus.FINISHED
        assert job.return_value()["token_ids"] == expected[spec.job_id]
        assert job.return_value()["usage"]["completion_tokens"] == len(expected[spec.job_id])
        assert state.first_token_at >= state.started_at > 0 and state.finished_at > 0
    assert Queue(_normal(pair), connection=pair.redis).count == 0
    assert FinishedJobRegistry(_normal(pair), connection=pair.redis).count == 12
    counts = {w.name: w.successful_job_count for w in Worker.all(connection=pair.redis)}
    assert sum(counts.values()) == 12 and min(counts.values()) > 0


def test_bad_jobs_fail_with_a_clear_message_and_the_worker_keeps_serving(
        pair: Fleet, reference_engine: object) -> None:
    model = pair.model_dir.name
    long_prompt = " ".join(["hello"] * 1100)
    num_long = len(reference_engine.tokenizer.encode(long_prompt))  # type: ignore[attr-defined]
    bad = {
        "too-long": (JobSpec(job_id=new_id(), model=model, prompt=long_prompt),
                     f"prompt ({num_long} tokens) leaves no room to generate within "
                     "max_model_len=1024; at most 1023 tokens fit"),
    }
    # Payloads no API would write (JobSpec refuses these values): the worker checks them again.
    raw = {"bad-temperature": ({"temperature": -1.0}, "temperature must be at least 0.0, got -1.0"),
           "bad-max-tokens": ({"max_tokens": 0}, "max_tokens must be at least 1, got 0")}
    raw_ids = {name: new_id() for name in raw}
    good = make_specs(model, 2, max_tokens=8)
    submit_jobs(pair.redis, [spec for spec, _ in bad.values()])
    for name, (sampling, _) in raw.items():
        enqueue_raw(pair.redis, {"job_id": raw_ids[name], "model": model, "prompt": "hi",
                                 "sampling": sampling}, raw_ids[name], model)
    # A payload no API would write: an RQ job whose argument is not a JobSpec.
    malformed_id = new_id()
    Queue(_normal(pair), connection=pair.redis, serializer=JSONSerializer).enqueue_call(
        RQ_JOB_FUNCTION, args=[42], job_id=malformed_id)
    submit_jobs(pair.redis, good)
    ids = [spec.job_id for spec, _ in bad.values()] + list(raw_ids.values()) + [malformed_id] + \
        [s.job_id for s in good]
    states = wait_final(pair, ids)
    reader = JobReader(pair.redis)
    for spec, message in bad.values():
        state = states[spec.job_id]
        assert state.status is JobStatus.FAILED
        assert state.error == message.format(w=state.worker)
        done = reader.read(spec.job_id).done
        assert (done.finish_reason, done.error) == (FinishReason.ERROR, state.error)
        job = Job.fetch(spec.job_id, pair.redis, serializer=JSONSerializer)
        assert job.get_status() == RQJobStatus.FAILED
        assert job.latest_result().exc_string == state.error
    for name, (_, message) in raw.items():
        assert states[raw_ids[name]].status is JobStatus.FAILED
        assert states[raw_ids[name]].error == f"malformed job: {message}"
    assert states[malformed_id].error == "malformed job: job spec must be a JSON object, got int"
    assert Job.fetch(malformed_id, pair.redis).get_status() == RQJobStatus.FAILED
    assert FailedJobRegistry(_normal(pair), connection=pair.redis).count == 4
    expected = expected_tokens(reference_engine, good)
    for spec in good:
        assert states[spec.job_id].status is JobStatus.FINISHED
        assert_stream_exact(pair.redis, spec.job_id, expected[spec.job_id])
    assert all(w.is_alive for w in pair.workers)


def _owner_with_tokens(pair: Fleet, job_id: str, min_tokens: int) -> str | None:
    state = JobReader(pair.redis).state(job_id)
    if state and state.status is JobStatus.RUNNING and \
            JobReader(pair.redis).num_tokens(job_id) >= min_tokens:
        return state.worker
    return None


def test_a_paused_worker_is_fenced_after_its_job_was_taken_over(
        pair: Fleet, reference_engine: object) -> None:
    # Long enough to be mid-generation when paused: the stream shows the first token at once and
    # the next ones only every CARPOOL_DURABLE_INTERVAL_MS (500), and the tiny model made 400
    # tokens in about that on a quiet Zen 4, so the wait is for the first token.
    (spec,) = make_specs(pair.model_dir.name, 1, max_tokens=1000, ignore_eos=True)
    expected = expected_tokens(reference_engine, [spec])[spec.job_id]
    fenced_before = int(pair.redis.hget(KEYS.counters(), "fenced_writes_total") or 0)
    submit_jobs(pair.redis, [spec])
    owner_name = wait_until(lambda: _owner_with_tokens(pair, spec.job_id, 1), 60,
                            "the job to start", pair.logs)
    owner = next(w for w in pair.workers if w.name == owner_name)
    other = next(w for w in pair.workers if w.name != owner_name)
    owner.signal(signal.SIGSTOP)  # a GC pause, a partition: alive but silent past its lease
    try:
        wait_until(lambda: JobReader(pair.redis).state(spec.job_id).worker == other.name, 30,
                   "the other worker to take the job over", pair.logs)
    finally:
        owner.signal(signal.SIGCONT)
    (state,) = wait_final(pair, [spec.job_id]).values()
    assert (state.status, state.worker, state.num_recoveries) == (
        JobStatus.FINISHED, other.name, 1)
    assert_stream_exact(pair.redis, spec.job_id, expected, FinishReason.LENGTH)
    # The paused worker's first write after waking was refused; it dropped the job.
    wait_until(lambda: int(pair.redis.hget(KEYS.counters(), "fenced_writes_total") or 0)
               > fenced_before, 30, "the zombie's refused write", pair.logs)
    assert owner.is_alive


def test_sigkill_mid_stream_loses_no_job(pair: Fleet, reference_engine: object) -> None:
    specs = make_specs(pair.model_dir.name, 4, max_tokens=300, ignore_eos=True)
    expected = expected_tokens(reference_engine, specs)
    submit_jobs(pair.redis, specs)
    victim_name = wait_until(lambda: next(
        (name for s in specs if (name := _owner_with_tokens(pair, s.job_id, 1))), None),
        60, "a job to stream", pair.logs)
    victim = next(w for w in pair.workers if w.name == victim_name)
    survivor = next(w for w in pair.workers if w.name != victim_name)
    victims_jobs = [s.job_id for s in specs
                    if JobReader(pair.redis).state(s.job_id).worker == victim_name]
    victim.signal(signal.SIGKILL)
    victim.wait(10)
    states = wait_final(pair, [s.job_id for s in specs])
    for spec in specs:
        state = states[spec.job_id]
        assert (state.status, state.worker) == (JobStatus.FINISHED, survivor.name), spec.job_id
        assert_stream_exact(pair.redis, spec.job_id, expected[spec.job_id], FinishReason.LENGTH)
        assert Job.fetch(spec.job_id, pair.redis).get_status() == RQJobStatus.FINISHED
    for job_id in victims_jobs:
        assert states[job_id].num_recoveries == 1
    assert FailedJobRegistry(_normal(pair), connection=pair.redis).count == 4  # bad jobs only
    assert pair.redis.zcard(KEYS.leases()) == 0


def _rq_cli(fleet: Fleet, *args: str) -> str:
    done = subprocess.run([sys.executable, "-m", "rq.cli", *args, "--url", fleet.redis_url],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


def test_rq_suspend_and_resume_hold_and_release_the_workers(
        pair: Fleet, reference_engine: object) -> None:
    """rq's own CLI: `rq suspend` and no worker starts a job (`rq info` shows them suspended),
    `rq resume` and the jobs run, token for token. (Last in the module: its jobs would add to
    the counts the tests above check.)"""
    live = {w.name for w in pair.workers if w.is_alive}
    specs = make_specs(pair.model_dir.name, 2, max_tokens=8)
    expected = expected_tokens(reference_engine, specs)
    _rq_cli(pair, "suspend")
    try:
        wait_until(lambda: {w.name: w.state for w in Worker.all(connection=pair.redis)
                            if w.name in live} == dict.fromkeys(live, "suspended"), 10,
                   "the live workers suspended", pair.logs)
        assert _rq_cli(pair, "info").count("suspended") >= len(live)
        submit_jobs(pair.redis, specs)
        time.sleep(2.0)  # four of the workers' waits
        reader = JobReader(pair.redis)
        assert [reader.state(s.job_id).status for s in specs] == [JobStatus.QUEUED] * 2
        assert Queue(_normal(pair), connection=pair.redis).count == 2
    finally:
        _rq_cli(pair, "resume")
    states = wait_final(pair, [s.job_id for s in specs])
    for spec in specs:
        assert states[spec.job_id].status is JobStatus.FINISHED
        assert_stream_exact(pair.redis, spec.job_id, expected[spec.job_id])
    wait_until(lambda: {w.state for w in Worker.all(connection=pair.redis) if w.name in live}
               == {"idle"}, 10, "the live workers idle again", pair.logs)


def test_rq_requeue_runs_a_failed_job_again_token_for_token(
        pair: Fleet, reference_engine: object) -> None:
    """`rq requeue` (rq's own CLI) of a job that failed on its worker (here a worker of the
    test's, its generation failing after two tokens): a live worker runs it again from its
    start, and its stream, result and rq records are this run's. (After the suspend test.)"""
    (spec,) = make_specs(pair.model_dir.name, 1, max_tokens=8)  # greedy
    expected = expected_tokens(reference_engine, [spec])[spec.job_id]
    queue_name = _normal(pair)
    scripts = JobScripts()
    scripts.load(pair.redis)
    crashed = JobQueue(pair.redis, scripts, KEYS, "crashed", pair.model_dir.name, 10_000,
                       execution_ttl_s=120, block_size=16)
    failed_before = FailedJobRegistry(queue_name, connection=pair.redis).count
    _rq_cli(pair, "suspend")  # the fleet's workers leave it to the test's
    try:
        submit_jobs(pair.redis, [spec])
        assert pair.redis.lpop(RQKeys.queue(queue_name)) == spec.job_id.encode()
        (claim,) = crashed.claim(0, adopt=(spec.job_id, crashed.queue_names.index(queue_name)))
        job = RunningJob(lease=claim.lease, spec=claim.spec, state=claim.state,
                         result_ttl=claim.result_ttl, failure_ttl=claim.failure_ttl,
                         num_prompt_tokens=3)
        job.add_tokens([TokenEntry(0, 7, "a"), TokenEntry(1, 8, "b")], now=time.time())
        publisher = StreamPublisher(pair.redis, scripts, KEYS, "crashed", 10_000)
        publisher.append(job)
        publisher.finish(job, JobEnd(JobStatus.FAILED, FinishReason.ERROR, "out of memory"))
        assert publisher.flush().ended == {spec.job_id: JobStatus.FAILED}
    finally:
        _rq_cli(pair, "resume")
    assert FailedJobRegistry(queue_name, connection=pair.redis).count == failed_before + 1
    _rq_cli(pair, "requeue", "--queue", queue_name, spec.job_id)
    reader = JobReader(pair.redis)
    state = wait_until(lambda: (s := reader.state(spec.job_id)).status is JobStatus.FINISHED and s,
                       30, "the requeued job finished", pair.logs)
    assert (state.status, state.error, list(state.token_ids)) == (JobStatus.FINISHED, "",
                                                                   expected)
    assert state.worker in {"alpha", "beta"}
    assert_stream_exact(pair.redis, spec.job_id, expected)
    rq_job = Job.fetch(spec.job_id, pair.redis, serializer=JSONSerializer)
    assert rq_job.get_status() == RQJobStatus.FINISHED
    assert rq_job.return_value()["token_ids"] == expected
    assert FailedJobRegistry(queue_name, connection=pair.redis).count == failed_before


def test_rqs_worker_commands_stop_a_job_and_shut_a_worker_down(pair: Fleet) -> None:
    """rq.command against the real workers: stop-job cancels the job on whichever worker runs
    it; shutdown drains that worker and its process exits 0. (Last: it stops a worker.)"""
    (spec,) = make_specs(pair.model_dir.name, 1, max_tokens=1000, ignore_eos=True)
    submit_jobs(pair.redis, [spec])
    reader = JobReader(pair.redis)
    state = wait_until(lambda: (s := reader.state(spec.job_id)).status is JobStatus.RUNNING
                       and pair.redis.xlen(KEYS.stream(spec.job_id)) > 0 and s, 30,
                       "the job running", pair.logs)
    send_stop_job_command(pair.redis, spec.job_id, serializer=JSONSerializer)
    ended = wait_until(lambda: (s := reader.state(spec.job_id)).status.is_final and s, 30,
                       "the job stopped", pair.logs)
    assert (ended.status, ended.finish_reason) == (JobStatus.CANCELED, FinishReason.CANCELED)
    assert len(ended.token_ids) < 1000
    (worker,) = [w for w in pair.workers if w.name == state.worker]
    send_shutdown_command(pair.redis, worker.name)
    assert worker.wait(timeout=30) == 0
