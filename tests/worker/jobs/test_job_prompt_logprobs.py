"""Prompt logprobs (#16) reach the job's state hash once, in the append that carries token 0,
on the main Redis and for a job whose stream is on a shard."""

from __future__ import annotations

from protocol.generation import PromptLogprobs, TokenEntry, TokenLogprobs
from protocol.job_reader import PROMPT_LOGPROBS_FIELD, JobReader
from tests.worker.jobs.job_support import KEYS, claim_one, fake_redis, generate, submit
from tests.worker.jobs.test_job_stream_shards import _claim, _worker

PROMPT_LOGPROBS = PromptLogprobs((5, 8, 9), (
    None, TokenLogprobs(-1.5, ((7, -0.25), (8, -1.5))), TokenLogprobs(-0.125, ((9, -0.125),))))


def test_they_go_with_token_0_and_a_resent_first_append_does_not_write_them_again() -> None:
    redis = fake_redis()
    job, pub = claim_one(redis)
    assert JobReader(redis).prompt_logprobs("job-1") is None
    job.prompt_logprobs = PROMPT_LOGPROBS.encode()
    generate(job, 11)
    pub.append(job)
    assert pub.flush().refused == set()
    assert JobReader(redis).prompt_logprobs("job-1") == PROMPT_LOGPROBS
    redis.hset(KEYS.state("job-1"), PROMPT_LOGPROBS_FIELD, "marker")
    job.unpublished = [TokenEntry(0, 11, "<11>")]  # a resent round trip: the same entry again
    pub.append(job)
    assert pub.flush().refused == set()
    assert redis.hget(KEYS.state("job-1"), PROMPT_LOGPROBS_FIELD) == b"marker"  # token 0 was there
    generate(job, 13)
    pub.append(job)  # a later token carries none
    pub.flush()
    assert redis.hget(KEYS.state("job-1"), PROMPT_LOGPROBS_FIELD) == b"marker"


def test_a_job_that_asked_for_none_has_no_field() -> None:
    redis = fake_redis()
    job, pub = claim_one(redis)
    generate(job, 11)
    pub.append(job)
    pub.flush()
    assert redis.hexists(KEYS.state("job-1"), PROMPT_LOGPROBS_FIELD) == 0
    assert JobReader(redis).prompt_logprobs("job-1") is None


def test_a_sharded_job_writes_them_on_the_main_redis_with_its_first_token() -> None:
    main, shard = fake_redis(), fake_redis()
    submit(main, "job-1")
    queue, shards, pub = _worker(main, shard)
    (job,) = _claim(queue, shards)
    job.prompt_logprobs = PROMPT_LOGPROBS.encode()
    generate(job, 11, 12)
    pub.append(job)
    assert pub.flush().refused == set()
    assert JobReader(main).prompt_logprobs("job-1") == PROMPT_LOGPROBS
    assert JobReader(main).state("job-1").first_token_at == 2000.0
