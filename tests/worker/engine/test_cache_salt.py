"""vLLM's cache_salt: prefix-cache blocks are shared only between requests of the same salt, in
the block manager and through the engine (usage's cached_tokens)."""

from __future__ import annotations

from typing import Any

import pytest

from tests.worker.conftest import make_engine
from worker.engine.block_manager import BlockManager
from worker.engine.engine import SamplingParams

PROMPT = list(range(100, 111))  # 11 tokens: two full blocks of 4, then 3


def computed(bm: BlockManager, seq_id: str, tokens: list[int], cache_salt: str | None) -> list[int]:
    """Allocate and 'compute' a whole sequence under `cache_salt`, registering its full blocks."""
    bm.allocate_cached_prefix(seq_id, tokens, cache_salt=cache_salt)
    table = bm.allocate(seq_id, len(tokens))
    assert table is not None
    bm.cache_computed_blocks(seq_id, tokens, len(tokens), cache_salt=cache_salt)
    return list(table)


@pytest.mark.parametrize(("first", "second"), [
    ("alice", "bob"), ("alice", None), (None, "alice"),
])
def test_the_same_prompt_under_another_salt_shares_no_block(first: str | None,
                                                             second: str | None) -> None:
    bm = BlockManager(num_blocks=8, block_size=4)
    first_table = computed(bm, "a", PROMPT, first)
    assert bm.allocate_cached_prefix("b", PROMPT, cache_salt=second) == 0
    assert "b" not in bm.tables
    second_table = computed(bm, "b", PROMPT, second)
    assert set(first_table).isdisjoint(second_table)
    assert len(bm.cached_block_ids) == 4  # each salt's two full blocks, registered apart


def test_the_same_salt_shares_as_before() -> None:
    bm = BlockManager(num_blocks=8, block_size=4)
    assert computed(bm, "a", PROMPT, "alice") == [0, 1, 2]
    assert bm.allocate_cached_prefix("b", PROMPT[:9] + [7, 7], cache_salt="alice") == 8
    assert bm.block_table("b") == [0, 1]
    assert [bm.blocks[i].ref_cnt for i in (0, 1, 2)] == [2, 2, 1]


def test_no_salt_shares_as_before() -> None:
    bm = BlockManager(num_blocks=8, block_size=4)
    assert computed(bm, "a", PROMPT, None) == [0, 1, 2]
    assert bm.allocate_cached_prefix("b", PROMPT) == 8  # the default is unsalted
    assert bm.block_table("b") == [0, 1]


def test_a_salt_registered_block_by_block_chains_as_at_once() -> None:
    # A prefill in chunks registers the later blocks from the earlier ones' hashes: the salt,
    # mixed into the first only, must carry through.
    bm = BlockManager(num_blocks=8, block_size=4)
    bm.allocate("a", len(PROMPT))
    bm.cache_computed_blocks("a", PROMPT, 4, cache_salt="alice")
    bm.cache_computed_blocks("a", PROMPT, len(PROMPT), cache_salt="alice")
    assert bm.allocate_cached_prefix("b", PROMPT, cache_salt="alice") == 8
    assert bm.allocate_cached_prefix("c", PROMPT, cache_salt="bob") == 0
    assert bm.allocate_cached_prefix("d", PROMPT) == 0


# -- the engine --------------------------------------------------------------------------------


def run_alone(engine: Any, request_id: str, prompt: list[int],
              cache_salt: str | None) -> tuple[list[int], int]:
    """One request to its end: (its tokens, the cached_tokens its output reported)."""
    engine.add_request(request_id, prompt, SamplingParams(max_tokens=3, temperature=0.0),
                       cache_salt=cache_salt)
    tokens: list[int] = []
    cached = -1
    while engine.has_unfinished():
        for request in engine.step().outputs:
            tokens += [entry.token_id for entry in request.tokens]
            cached = request.num_cached_tokens
    return tokens, cached


def test_engine_reuses_a_prefix_only_under_the_same_salt(tiny_llama: Any) -> None:
    engine = make_engine(tiny_llama)  # blocks of 4 tokens
    prompt = list(range(300, 313))  # 13 tokens: three full blocks may come from the cache
    answers = {request_id: run_alone(engine, request_id, prompt, salt) for request_id, salt in [
        # Unsalted first: a salted lookup that ignored its salt would find these blocks.
        ("unsalted-1", None), ("alice-1", "alice"), ("bob-1", "bob"),
        ("alice-2", "alice"), ("bob-2", "bob"), ("unsalted-2", None)]}
    cached = {request_id: num_cached for request_id, (_, num_cached) in answers.items()}
    assert cached == {"alice-1": 0, "bob-1": 0, "unsalted-1": 0,
                      "alice-2": 12, "bob-2": 12, "unsalted-2": 12}
    # The salt picks what is reused, never what is generated.
    assert len({tuple(tokens) for tokens, _ in answers.values()}) == 1
    assert engine.num_free_kv_blocks() == engine.block_manager.num_blocks


@pytest.mark.parametrize("cache_salt", ["", 5])
def test_engine_refuses_a_salt_that_is_not_a_non_empty_string(tiny_llama: Any,
                                                              cache_salt: Any) -> None:
    engine = make_engine(tiny_llama)
    with pytest.raises(ValueError, match="cache_salt must be a non-empty string"):
        engine.add_request("r", [5, 6], SamplingParams(max_tokens=2), cache_salt=cache_salt)
    assert not engine.has_unfinished()
