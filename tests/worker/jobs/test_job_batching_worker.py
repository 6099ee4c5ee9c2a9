"""The worker loop in-process (real engine, tiny model, fakeredis): modes, cancel, drain."""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import fakeredis
import pytest
from rq.command import send_kill_horse_command, send_shutdown_command, send_stop_job_command
from rq.serializers import JSONSerializer
from rq.suspension import resume, suspend

from protocol import (
    FinishReason,
    JobReader,
    JobSpec,
    JobStatus,
    SamplingParams,
    WorkerStats,
    cancel_job,
    submit_jobs,
)
from protocol.rq_keys import RQKeys
from tests.worker.jobs.job_support import KEYS
from tests.worker.jobs.synthetic_worker import wait_for


@pytest.fixture(scope="module")
def engines(tiny_llama_dir: Path) -> dict[str, object]:
    from worker.engine.engine import Engine
    from worker.jobs.settings import WorkerSettings

    out = {}
    for mode in ("continuous", "static", "sequential"):
        settings = WorkerSettings(model=str(tiny_llama_dir), dtype="float32", redis_url="redis://unused",
                                  name=f"w-{mode}", mode=mode, max_num_seqs=3, lease_seconds=5,
                                  drain_seconds=0, idle_block_seconds=0.05, num_threads=1)
        out[mode] = (settings, Engine(settings.engine_config()))
    return out


class Running:
    def __init__(self, settings, engine) -> None:
        from worker.jobs.batching_worker import BatchingWorker

        server = fakeredis.FakeServer()
        self.redis = fakeredis.FakeRedis(server=server)
        self.worker = BatchingWorker(settings, engine, self.redis,
                                     presence_redis=fakeredis.FakeRedis(server=server))
        self.thread = threading.Thread(target=self.worker.run, daemon=True)
        self.thread.start()

    def stop(self) -> None:
        self.worker.request_stop(15, None)
        self.thread.join(30)
        assert not self.thread.is_alive()


@pytest.fixture()
def running(request: pytest.FixtureRequest, engines) -> Iterator[Running]:
    run = Running(*engines[request.param])
    yield run
    run.stop()


def _specs(model: str, count: int, max_tokens: int = 6) -> list[JobSpec]:
    return [JobSpec(job_id=f"job-{i}", model=model, prompt=f"Say {i}",
                    sampling=SamplingParams(max_tokens=max_tokens, temperature=0.0)) for i in range(count)]


@pytest.fixture(scope="module")
def reference(tiny_llama_dir: Path) -> object:
    """An engine of its own (the workers' engines are busy in their threads)."""
    from worker.engine.config import EngineConfig
    from worker.engine.engine import Engine

    return Engine(EngineConfig(model=str(tiny_llama_dir), dtype="float32", num_threads=1))


@pytest.mark.parametrize("running", ["continuous", "static", "sequential"], indirect=True)
def test_every_mode_runs_jobs_to_the_engines_own_output(running: Running, reference) -> None:
    from protocol.generation import SamplingParams

    specs = _specs(running.worker.settings.served_model_name, 5)
    submit_jobs(running.redis, specs)
    reader = JobReader(running.redis)
    states = wait_for(lambda: (s := [reader.state(x.job_id) for x in specs]) and
                   all(st.status.is_final for st in s) and s)
    expected = reference.generate([s.prompt for s in specs],
                                  SamplingParams(max_tokens=6, temperature=0.0))
    assert [list(s.token_ids) for s in states] == [list(c.token_ids) for c in expected]
    assert all(s.status is JobStatus.FINISHED for s in states)


@pytest.mark.parametrize("running", ["continuous"], indirect=True)
def test_cancel_a_running_job_frees_its_blocks(running: Running) -> None:
    (spec,) = _specs(running.worker.settings.served_model_name, 1, max_tokens=900)
    spec = dataclasses.replace(spec, sampling=dataclasses.replace(spec.sampling, ignore_eos=True))
    submit_jobs(running.redis, [spec])
    # The first token shows the job running; later ones reach the stream every durable interval.
    wait_for(lambda: running.redis.xlen(KEYS.stream(spec.job_id)) >= 1)
    assert cancel_job(running.redis, spec.job_id) is JobStatus.RUNNING
    reader = JobReader(running.redis)
    wait_for(lambda: reader.state(spec.job_id).status is JobStatus.CANCELED)
    stats = wait_for(lambda: (s := WorkerStats.from_fields(
        running.redis.hgetall(KEYS.worker_stats(running.worker.name)))).num_running == 0
        and s.num_kv_blocks_used == 0 and s)
    assert stats.num_kv_blocks_total > 0
    assert running.worker.engine.num_free_kv_blocks() == stats.num_kv_blocks_total
    assert stats.num_jobs == 0


@pytest.mark.parametrize("running", ["continuous"], indirect=True)
def test_a_claim_lost_to_redis_dropping_after_a_wakeup_loses_no_job(running: Running) -> None:
    """The idle wait pops a wake-up, not a job, and then claims: if Redis drops in between, the
    job is still on its queue and the next claim takes it."""
    from redis.exceptions import ConnectionError as RedisConnectionError

    queue = running.worker.queue
    real_claim = queue.claim
    failed: list[int] = []

    def claim_failing_once(max_jobs: int, free_kv_blocks: int | None = None,
                           adopt: tuple[str, int] | None = None) -> list:
        if not failed and running.redis.llen(RQKeys.queue(queue.queue_names[1])):
            failed.append(max_jobs)
            raise RedisConnectionError("Connection closed by server.")
        return real_claim(max_jobs, free_kv_blocks, adopt=adopt)

    queue.claim = claim_failing_once  # type: ignore[method-assign]
    (spec,) = _specs(running.worker.settings.served_model_name, 1)
    submit_jobs(running.redis, [spec])
    reader = JobReader(running.redis)
    state = wait_for(lambda: (s := reader.state(spec.job_id)) and s.status.is_final and s)
    assert len(failed) == 1
    assert state.status is JobStatus.FINISHED and len(state.token_ids) == 6


@pytest.mark.parametrize("running", ["continuous"], indirect=True)
def test_a_job_past_its_queue_timeout_or_deadline_is_never_started(running: Running) -> None:
    model = running.worker.settings.served_model_name
    late, overdue, fine = _specs(model, 3)
    past = time.time() - 1
    late = dataclasses.replace(late, queue_deadline_at=past)
    overdue = dataclasses.replace(overdue, deadline_at=past)
    fine = dataclasses.replace(fine, queue_deadline_at=time.time() + 600,
                               deadline_at=time.time() + 600)
    submit_jobs(running.redis, [late, overdue, fine])
    reader = JobReader(running.redis)
    states = wait_for(lambda: (s := [reader.state(x.job_id) for x in (late, overdue, fine)]) and
                   all(st.status.is_final for st in s) and s)
    for state in states[:2]:
        assert (state.status, state.finish_reason, state.token_ids) == (
            JobStatus.FINISHED, FinishReason.EXPIRED, ())
        assert [e.kind for e in reader.read(state.job_id).entries] == ["done"]
        assert reader.read(state.job_id).done.finish_reason is FinishReason.EXPIRED
    assert (states[2].finish_reason, len(states[2].token_ids)) == (FinishReason.LENGTH, 6)
    counters = running.redis.hgetall(KEYS.counters())
    assert int(counters[b"jobs_expired_total"]) == 2


@pytest.mark.parametrize("running", ["continuous"], indirect=True)
def test_a_running_job_past_its_deadline_ends_at_a_step_boundary_and_frees_its_blocks(
        running: Running) -> None:
    warm, spec = _specs(running.worker.settings.served_model_name, 2, max_tokens=1000)
    # A short job first, so the deadline's window below holds no worker start-up: once on a slow
    # 2-vCPU Zen 3 the job got no token before its deadline 0.6 s after submission.
    warm = dataclasses.replace(warm, sampling=dataclasses.replace(warm.sampling, max_tokens=2))
    submit_jobs(running.redis, [warm])
    reader = JobReader(running.redis)
    wait_for(lambda: (s := reader.state(warm.job_id)) and s.status.is_final)
    # The deadline well inside the generation: the tiny model on one thread made 900 tokens in
    # under 1.5 s on a quiet 2-vCPU Zen 4 (about 1.6 ms a step).
    spec = dataclasses.replace(spec, sampling=dataclasses.replace(spec.sampling, ignore_eos=True),
                               deadline_at=time.time() + 0.6,
                               queue_deadline_at=time.time() + 0.3)
    submit_jobs(running.redis, [spec])
    state = wait_for(lambda: (s := reader.state(spec.job_id)) and s.status.is_final and s)
    # The queue timeout no longer applies once it started; the deadline ended it mid-generation.
    assert (state.status, state.finish_reason) == (JobStatus.FINISHED, FinishReason.EXPIRED)
    assert 0 < len(state.token_ids) < 1000
    assert state.finished_at >= spec.deadline_at
    read = reader.read(spec.job_id)
    assert [e.token_id for e in read.tokens] == list(state.token_ids)
    assert read.done.finish_reason is FinishReason.EXPIRED
    assert read.done.completion_tokens == len(state.token_ids)
    stats = wait_for(lambda: (s := WorkerStats.from_fields(
        running.redis.hgetall(KEYS.worker_stats(running.worker.name)))).num_running == 0
        and s.num_kv_blocks_used == 0 and s)
    assert running.worker.engine.num_free_kv_blocks() == stats.num_kv_blocks_total


def test_the_model_card_carries_generation_config_defaults(tmp_path: Path) -> None:
    from types import SimpleNamespace

    from worker.jobs.batching_worker import BatchingWorker

    worker = BatchingWorker.__new__(BatchingWorker)  # only the engine's model_dir is read
    worker.engine = SimpleNamespace(model_dir=tmp_path)  # type: ignore[assignment]
    assert worker._generation_defaults() == {}
    (tmp_path / "generation_config.json").write_text(
        '{"bos_token_id": 1, "temperature": 0.7, "top_p": 0.8, "top_k": 20, "do_sample": true}')
    assert worker._generation_defaults() == {"temperature": 0.7, "top_p": 0.8, "top_k": 20}
    (tmp_path / "generation_config.json").write_text("{not json")
    assert worker._generation_defaults() == {}


@pytest.mark.parametrize("running", ["continuous"], indirect=True)
def test_batch_tier_jobs_give_their_seats_to_a_higher_tier_and_resume_exactly(
        running: Running, reference) -> None:
    from protocol import Priority

    model = running.worker.settings.served_model_name
    long = SamplingParams(max_tokens=60, temperature=0.0, ignore_eos=True)
    batch = [dataclasses.replace(spec, job_id=f"batch-{i}", priority=Priority.BATCH, sampling=long)
             for i, spec in enumerate(_specs(model, 3))]  # three seats: the worker is full
    submit_jobs(running.redis, batch)
    wait_for(lambda: all(JobReader(running.redis).num_tokens(s.job_id) >= 1 for s in batch))
    (urgent,) = [dataclasses.replace(spec, job_id="urgent", priority=Priority.HIGH)
                 for spec in _specs(model, 1)]
    submit_jobs(running.redis, [urgent])
    reader = JobReader(running.redis)
    urgent_state = wait_for(lambda: (s := reader.state("urgent")).status.is_final and s)
    states = wait_for(lambda: (s := [reader.state(x.job_id) for x in batch]) and
                   all(st.status.is_final for st in s) and s)
    # The urgent job ran while batch jobs were still unfinished: one of them gave way.
    assert urgent_state.finished_at < max(s.finished_at for s in states)
    assert sum(s.num_preemptions for s in states) >= 1
    expected = reference.generate([s.prompt for s in batch], long)
    assert [list(s.token_ids) for s in states] == [list(c.token_ids) for c in expected]
    (urgent_expected,) = reference.generate([urgent.prompt], urgent.sampling)
    assert list(urgent_state.token_ids) == list(urgent_expected.token_ids)


@pytest.mark.parametrize("running", ["continuous"], indirect=True)
def test_a_free_seat_sends_no_claim_while_the_last_publish_read_every_queue_empty(
        running: Running, reference) -> None:
    """[redis-cost] Each publish reads the queues' lengths in its own transaction; at the next
    boundary a worker with a free seat claims only if that reading found a job, so a busy worker
    with nothing queued sends no claim a step, and a job queued meanwhile still starts."""
    queue = running.worker.queue
    real_claim = queue.claim
    busy_claims: list[int] = []  # jobs each claim took, for claims made while holding jobs

    def counting_claim(max_jobs: int, free_kv_blocks: int | None = None,
                       adopt: tuple[str, int] | None = None) -> list:
        held = bool(running.worker.jobs)
        claims = real_claim(max_jobs, free_kv_blocks, adopt=adopt)
        if held:
            busy_claims.append(len(claims))
        return claims

    queue.claim = counting_claim  # type: ignore[method-assign]
    model = running.worker.settings.served_model_name
    long = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    first, second = [dataclasses.replace(spec, sampling=long) for spec in _specs(model, 2)]
    submit_jobs(running.redis, [first])
    # Counted in the worker: its stream may hold them only later (live tokens, written once due).
    wait_for(lambda: (job := running.worker.jobs.get(first.job_id)) is not None
             and job.num_tokens >= 10)
    assert busy_claims == []  # ten steps with two free seats and nothing queued: no claim
    submit_jobs(running.redis, [second])
    reader = JobReader(running.redis)
    states = wait_for(lambda: (s := [reader.state(x.job_id) for x in (first, second)]) and
                   all(st.status.is_final for st in s) and s)
    # The second job was claimed by a claim the publish's reading called for, and no claim
    # came back empty.
    assert busy_claims == [1]
    assert states[0].started_at < states[1].started_at < states[0].finished_at
    expected = reference.generate([first.prompt, second.prompt], long)
    assert [list(s.token_ids) for s in states] == [list(c.token_ids) for c in expected]


@pytest.mark.parametrize("running", ["continuous"], indirect=True)
def test_a_woken_worker_whose_claim_emptied_the_queues_does_not_claim_again_at_once(
        running: Running, reference) -> None:
    """[redis-cost] An idle worker woken by a job claims it; that claim, short of the seats it
    asked for with no KV budget to stop it, found every queue empty, so the boundary right after
    sends no second (empty) claim: one claim for the job, none while it runs."""
    queue = running.worker.queue
    real_claim = queue.claim
    claims_made: list[tuple[bool, int]] = []  # (held jobs when asked, jobs taken)

    def counting_claim(max_jobs: int, free_kv_blocks: int | None = None,
                       adopt: tuple[str, int] | None = None) -> list:
        held = bool(running.worker.jobs)
        claims = real_claim(max_jobs, free_kv_blocks, adopt=adopt)
        claims_made.append((held, len(claims)))
        return claims

    queue.claim = counting_claim  # type: ignore[method-assign]
    model = running.worker.settings.served_model_name
    spec = dataclasses.replace(_specs(model, 1)[0], sampling=SamplingParams(
        max_tokens=12, temperature=0.0, ignore_eos=True))
    time.sleep(0.2)  # the worker is idle, blocked on its wake-up lists
    claims_made.clear()
    submit_jobs(running.redis, [spec])
    reader = JobReader(running.redis)
    state = wait_for(lambda: (s := reader.state(spec.job_id)) and s.status.is_final and s)
    taken = [entry for entry in claims_made if entry[1]]
    assert taken == [(False, 1)]
    assert [entry for entry in claims_made if entry[0]] == []  # no claim while it ran
    expected = reference.generate([spec.prompt], spec.sampling)
    assert list(state.token_ids) == list(expected[0].token_ids)


def _rq_state(running: Running) -> str:
    return running.redis.hget(RQKeys.worker(running.worker.name), "state").decode()


def _stats(running: Running) -> WorkerStats:
    return WorkerStats.from_fields(running.redis.hgetall(KEYS.worker_stats(running.worker.name)))


@pytest.mark.parametrize("running", ["continuous"], indirect=True)
def test_rq_suspend_lets_running_jobs_finish_and_starts_none_until_rq_resume(
        running: Running, reference) -> None:
    """rq's contract for `rq suspend`: "No new jobs will be started. But current jobs will be
    completed." A busy worker learns it from its next claim, an idle one from its next wait;
    `rq resume` starts the waiting jobs within about a second."""
    model = running.worker.settings.served_model_name
    long = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    running_job, held_back, held_while_idle = [
        dataclasses.replace(spec, sampling=long) for spec in _specs(model, 3)]
    submit_jobs(running.redis, [running_job])
    wait_for(lambda: (job := running.worker.jobs.get(running_job.job_id)) is not None
             and job.num_tokens >= 2)
    suspend(running.redis)
    submit_jobs(running.redis, [held_back])
    reader = JobReader(running.redis)
    # The running job goes on to its end; the worker, suspended, shows it to rq and /v1/stats.
    finished = wait_for(lambda: (s := reader.state(running_job.job_id)).status.is_final and s)
    assert finished.status is JobStatus.FINISHED and len(finished.token_ids) == 40
    wait_for(lambda: _rq_state(running) == "suspended" and _stats(running).suspended)
    time.sleep(1.5)  # idle and suspended: over a second of waits
    assert reader.state(held_back.job_id).status is JobStatus.QUEUED
    assert running.redis.llen(RQKeys.queue(running.worker.queue.queue_names[1])) == 1
    assert running.worker.jobs == {}

    resume(running.redis)
    started = wait_for(lambda: (s := reader.state(held_back.job_id)).status.is_final and s)
    assert started.status is JobStatus.FINISHED
    wait_for(lambda: _rq_state(running) == "idle" and not _stats(running).suspended)

    # Suspended while idle: its next wait reads it, and a job submitted then waits too.
    suspend(running.redis)
    wait_for(lambda: _rq_state(running) == "suspended")
    submit_jobs(running.redis, [held_while_idle])
    time.sleep(1.5)
    assert reader.state(held_while_idle.job_id).status is JobStatus.QUEUED
    resume(running.redis)
    last = wait_for(lambda: (s := reader.state(held_while_idle.job_id)).status.is_final and s)
    expected = reference.generate([running_job.prompt, held_back.prompt, held_while_idle.prompt],
                                  long)
    assert [list(s.token_ids) for s in (finished, started, last)] == [
        list(c.token_ids) for c in expected]


@pytest.mark.parametrize("running", ["continuous"], indirect=True)
def test_rqs_stop_job_command_cancels_its_job_and_its_shutdown_command_drains_the_worker(
        running: Running, reference) -> None:
    """rq.command's functions, as an rq user calls them: stop-job ends that one job canceled
    (the other runs on to its own end), shutdown stops the worker as SIGTERM does."""
    model = running.worker.settings.served_model_name
    stopped, other = [dataclasses.replace(spec, sampling=SamplingParams(
        max_tokens=max_tokens, temperature=0.0, ignore_eos=True))
        for spec, max_tokens in zip(_specs(model, 2), (900, 30))]
    submit_jobs(running.redis, [stopped, other])
    wait_for(lambda: all((job := running.worker.jobs.get(spec.job_id)) is not None
                         and job.num_tokens >= 2 for spec in (stopped, other)))
    send_stop_job_command(running.redis, stopped.job_id, serializer=JSONSerializer)
    reader = JobReader(running.redis)
    states = wait_for(lambda: (s := [reader.state(x.job_id) for x in (stopped, other)]) and
                      all(st.status.is_final for st in s) and s)
    assert [s.status for s in states] == [JobStatus.CANCELED, JobStatus.FINISHED]
    assert states[0].finish_reason is FinishReason.CANCELED and len(states[0].token_ids) < 900
    expected = reference.generate([other.prompt], other.sampling)
    assert list(states[1].token_ids) == list(expected[0].token_ids)
    assert running.worker.engine.num_free_kv_blocks() == _stats(running).num_kv_blocks_total
    send_kill_horse_command(running.redis, running.worker.name)  # no work horse: ignored
    send_shutdown_command(running.redis, running.worker.name)
    running.thread.join(10)
    assert not running.thread.is_alive()
    assert running.redis.hget(RQKeys.worker(running.worker.name), "death") is not None
