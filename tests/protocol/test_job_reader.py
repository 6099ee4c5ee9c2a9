from __future__ import annotations

import fakeredis

from protocol import FinishReason, JobReader, Keys, StreamEntry, stream_ids, submit_job
from protocol.job_reader import parse_entries
from protocol.stream_ids import entry_index
from tests.protocol.conftest import make_spec

KEYS = Keys()


def _fill(redis: fakeredis.FakeRedis, job_id: str, num_tokens: int, done: bool) -> None:
    for i in range(num_tokens):
        entry = StreamEntry(kind="token", index=i, token_id=100 + i, text=str(i))
        redis.xadd(KEYS.stream(job_id), entry.to_fields(), id=stream_ids.token_entry_id(i))
    if done:
        entry = StreamEntry(kind="done", finish_reason=FinishReason.LENGTH, prompt_tokens=2,
                            completion_tokens=num_tokens)
        redis.xadd(KEYS.stream(job_id), entry.to_fields(), id=stream_ids.done_entry_id(num_tokens))


def test_read_from_the_start_and_resume_after_an_id(fake_redis: fakeredis.FakeRedis) -> None:
    _fill(fake_redis, "j", 4, done=True)
    reader = JobReader(fake_redis)
    first = reader.read("j", count=2)
    assert [e.index for e in first.entries] == [0, 1] and first.last_id == "0-2"
    assert not first.is_done
    rest = reader.read("j", after=first.last_id)
    assert [e.index for e in rest.tokens] == [2, 3]
    assert rest.is_done and rest.done.completion_tokens == 4 and rest.last_id == "0-5"
    assert reader.token_ids("j") == [100, 101, 102, 103]
    assert reader.read("j", after=rest.last_id).entries == []


def test_blocking_read_returns_new_entries_or_nothing(fake_redis: fakeredis.FakeRedis) -> None:
    _fill(fake_redis, "j", 2, done=False)
    reader = JobReader(fake_redis)
    assert [e.index for e in reader.read("j", block_ms=10).entries] == [0, 1]
    empty = reader.read("j", after="0-2", block_ms=10)
    assert empty.entries == [] and empty.last_id == "0-2"


def test_entry_ids_map_to_indices() -> None:
    assert entry_index("0-1") == 0
    assert entry_index(b"0-10") == 9
    assert parse_entries([]).last_id == "0-0"


def test_result_only_once_final(fake_redis: fakeredis.FakeRedis) -> None:
    submit_job(fake_redis, make_spec("j"))
    reader = JobReader(fake_redis)
    assert reader.result("j") is None
    fake_redis.hset(KEYS.state("j"), mapping={"status": "finished", "text": "hi",
                                              "token_ids": "[1,2]", "finish_reason": "stop"})
    result = reader.result("j")
    assert (result.text, result.token_ids, result.finish_reason) == (
        "hi", [1, 2], FinishReason.STOP)
    assert reader.state("missing") is None
