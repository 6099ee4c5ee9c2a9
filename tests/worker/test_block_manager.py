from __future__ import annotations

import pytest

from worker.block_manager import BlockManager


def test_allocate_grows_a_table_block_by_block() -> None:
    bm = BlockManager(num_blocks=4, block_size=4)
    assert bm.allocate("a", 1) == [3]
    assert bm.allocate("a", 4) == [3]
    assert bm.allocate("a", 5) == [3, 2]
    assert bm.num_free_blocks == 2
    assert bm.num_used_blocks == 2
    assert [block.ref_cnt for block in bm.blocks] == [0, 0, 1, 1]


def test_allocation_failure_returns_none_and_changes_nothing() -> None:
    bm = BlockManager(num_blocks=3, block_size=2)
    assert bm.allocate("a", 4) is not None
    assert bm.allocate("b", 4) is None
    assert "b" not in bm.tables
    assert bm.allocate("a", 8) is None
    assert bm.block_table("a") == [2, 1]
    assert bm.num_free_blocks == 1


def test_free_returns_every_block_and_is_idempotent() -> None:
    bm = BlockManager(num_blocks=4, block_size=2)
    bm.allocate("a", 5)
    bm.allocate("b", 2)
    bm.free("a")
    bm.free("a")
    assert bm.num_free_blocks == 3
    assert bm.block_table("a") == []
    assert [block.ref_cnt for block in bm.blocks] == [1, 0, 0, 0]
    bm.free("b")
    assert sorted(bm.free_block_ids) == [0, 1, 2, 3]


def test_freed_blocks_are_reused_newest_first() -> None:
    bm = BlockManager(num_blocks=4, block_size=1)
    bm.allocate("a", 2)  # blocks 3, 2
    bm.free("a")
    assert bm.allocate("b", 1) == [2]


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
