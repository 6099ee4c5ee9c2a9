"""A plain `rq worker` can run a Carpool job too (unbatched), through worker.rq_entry."""

from __future__ import annotations

from pathlib import Path

from rq import SimpleWorker
from rq.job import Job
from rq.job import JobStatus as RQJobStatus
from rq.serializers import JSONSerializer

from protocol import FinishReason, JobReader, JobSpec, JobStatus, Keys, SamplingParams, submit_job
from tests.conftest import enqueue_raw
from tests.worker.jobs.job_support import fake_redis


def test_a_plain_rq_worker_runs_a_job_and_streams_it(tiny_llama_dir: Path) -> None:
    from worker import rq_entry

    redis = fake_redis()
    spec = JobSpec(job_id="plain-1", model=str(tiny_llama_dir), prompt="Hello there",
                   sampling=SamplingParams(max_tokens=6, temperature=0.0))
    submit_job(redis, spec)
    worker = SimpleWorker(Keys().queue_names(str(tiny_llama_dir)), connection=redis, serializer=JSONSerializer)
    assert worker.work(burst=True)
    engine = rq_entry._engines[str(tiny_llama_dir)]
    (reference,) = engine.generate(["Hello there"], SamplingParams(max_tokens=6, temperature=0.0))
    job = Job.fetch("plain-1", redis, serializer=JSONSerializer)
    assert job.get_status() == RQJobStatus.FINISHED
    result = job.return_value()
    assert result["token_ids"] == list(reference.token_ids)
    assert (result["status"], result["finish_reason"]) == ("finished", "length")
    read = JobReader(redis).read("plain-1")
    assert [e.token_id for e in read.tokens] == list(reference.token_ids)
    assert read.done.finish_reason is FinishReason.LENGTH and read.last_id == "0-7"
    state = JobReader(redis).state("plain-1")
    assert (state.status, list(state.token_ids)) == (JobStatus.FINISHED, list(reference.token_ids))


def test_a_bad_job_fails_on_a_plain_rq_worker_with_the_message(tiny_llama_dir: Path) -> None:
    redis = fake_redis()
    enqueue_raw(redis, {"job_id": "plain-2", "model": str(tiny_llama_dir), "prompt": "x",
                        "sampling": {"temperature": -2.0}}, "plain-2", str(tiny_llama_dir))
    SimpleWorker(Keys().queue_names(str(tiny_llama_dir)), connection=redis, serializer=JSONSerializer).work(burst=True)
    job = Job.fetch("plain-2", redis, serializer=JSONSerializer)
    assert job.get_status() == RQJobStatus.FAILED
    assert "malformed job: temperature must be at least 0.0, got -2.0" in job.latest_result().exc_string
    state = JobReader(redis).state("plain-2")
    assert (state.status, state.error) == (JobStatus.FAILED,
                                           "malformed job: temperature must be at least 0.0, got -2.0")
    assert JobReader(redis).read("plain-2").done.finish_reason is FinishReason.ERROR
