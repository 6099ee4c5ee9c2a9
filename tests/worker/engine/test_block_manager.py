from __future__ import annotations

import pytest

from worker.engine.block_manager import BlockManager


def test_allocate_grows_a_table_block_by_block() -> None:
    bm = BlockManager(num_blocks=4, block_size=4)
    assert bm.allocate("a", 1) == [0]
    assert bm.allocate("a", 4) == [0]
    assert bm.allocate("a", 5) == [0, 1]
    assert bm.num_free_blocks == 2
    assert bm.num_used_blocks == 2
    assert [block.ref_cnt for block in bm.blocks] == [1, 1, 0, 0]


def test_allocation_failure_returns_none_and_changes_nothing() -> None:
    bm = BlockManager(num_blocks=3, block_size=2)
    assert bm.allocate("a", 4) is not None
    assert bm.allocate("b", 4) is None
    assert "b" not in bm.tables
    assert bm.allocate("a", 8) is None
    assert bm.block_table("a") == [0, 1]
    assert bm.num_free_blocks == 1


def test_free_returns_every_block_and_is_idempotent() -> None:
    bm = BlockManager(num_blocks=4, block_size=2)
    bm.allocate("a", 5)
    bm.allocate("b", 2)
    bm.free("a")
    bm.free("a")
    assert bm.num_free_blocks == 3
    assert bm.block_table("a") == []
    assert [block.ref_cnt for block in bm.blocks] == [0, 0, 0, 1]
    bm.free("b")
    assert sorted(bm.free_block_ids) == [0, 1, 2, 3]


def test_counts_of_needed_blocks_and_free_slots() -> None:
    bm = BlockManager(num_blocks=5, block_size=4)
    assert bm.num_blocks_for(0) == 0
    assert bm.num_blocks_for(9) == 3
    bm.allocate("a", 3)
    assert bm.num_blocks_needed("a", 4) == 0
    assert bm.num_blocks_needed("a", 9) == 2
    assert bm.num_blocks_needed("b", 9) == 3
    assert bm.num_free_slots("a", 3) == 4 * 5 - 3
    assert bm.num_free_slots("b", 0) == 4 * 4


@pytest.mark.parametrize(("num_blocks", "block_size"), [(0, 4), (4, 0)])
def test_rejects_an_empty_pool(num_blocks: int, block_size: int) -> None:
    with pytest.raises(ValueError, match="must be at least 1"):
        BlockManager(num_blocks, block_size)


# -- prefix caching ----------------------------------------------------------------------------

PROMPT = list(range(100, 111))  # 11 tokens: two full blocks of 4, then 3


def computed(bm: BlockManager, seq_id: str, tokens: list[int]) -> list[int]:
    """Allocate and 'compute' a whole sequence, registering its full blocks."""
    cached = bm.allocate_cached_prefix(seq_id, tokens)
    table = bm.allocate(seq_id, len(tokens))
    assert table is not None
    bm.cache_computed_blocks(seq_id, tokens, len(tokens))
    return [cached, *table]


def test_a_shared_prefix_is_taken_from_the_cache() -> None:
    bm = BlockManager(num_blocks=8, block_size=4)
    assert computed(bm, "a", PROMPT) == [0, 0, 1, 2]
    assert bm.allocate_cached_prefix("b", PROMPT[:9] + [7, 7]) == 8
    assert bm.block_table("b") == [0, 1]
    assert [bm.blocks[i].ref_cnt for i in (0, 1, 2)] == [2, 2, 1]
    assert bm.num_free_blocks == 5


def test_the_last_token_is_never_taken_from_the_cache() -> None:
    bm = BlockManager(num_blocks=8, block_size=4)
    computed(bm, "a", PROMPT[:8])
    assert bm.allocate_cached_prefix("b", PROMPT[:8]) == 4  # 8 tokens: only the first block


def test_a_different_earlier_block_breaks_the_chain() -> None:
    bm = BlockManager(num_blocks=8, block_size=4)
    computed(bm, "a", PROMPT)
    other = [1, 2, 3, 4] + PROMPT[4:]  # same second block, after a different first one
    assert bm.allocate_cached_prefix("b", other) == 0
    assert "b" not in bm.tables


def test_freed_cached_blocks_stay_findable_until_evicted() -> None:
    bm = BlockManager(num_blocks=3, block_size=4)
    computed(bm, "a", PROMPT)
    bm.free("a")
    assert bm.num_free_blocks == 3
    assert bm.allocate_cached_prefix("b", PROMPT) == 8  # revived from the free list
    assert bm.num_free_blocks == 1
    bm.free("b")
    assert bm.allocate("c", 12) is not None  # needs every block: the cached ones are evicted
    assert bm.cached_block_ids == {}
    bm.free("c")
    assert bm.allocate_cached_prefix("d", PROMPT) == 0


def test_the_tail_of_a_freed_sequence_is_evicted_first() -> None:
    bm = BlockManager(num_blocks=4, block_size=4)
    computed(bm, "a", PROMPT + [111, 112])  # 13 tokens: blocks 0, 1, 2 full, block 3 partial
    bm.free("a")
    assert bm.allocate("b", 4) == [3]  # the uncached partial block goes first
    assert bm.allocate("b", 8) == [3, 2]  # then the last full one, keeping the prefix cached
    assert bm.allocate_cached_prefix("c", PROMPT) == 8


def test_prefix_caching_can_be_turned_off() -> None:
    bm = BlockManager(num_blocks=8, block_size=4, enable_prefix_caching=False)
    computed(bm, "a", PROMPT)
    assert bm.allocate_cached_prefix("b", PROMPT) == 0
    assert bm.cached_block_ids == {}
