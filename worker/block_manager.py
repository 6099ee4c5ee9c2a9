"""The KV cache's bookkeeping: a pool of fixed-size blocks and one block table per sequence.

Pure Python: it hands out block ids; the model runner owns the tensors they index.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass


@dataclass(slots=True)
class Block:
    block_id: int
    ref_cnt: int = 0  # tables holding this block; 0 means it is on the free list


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be at least 1, got {num_blocks}")
        if block_size < 1:
            raise ValueError(f"block_size must be at least 1, got {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.blocks = [Block(block_id) for block_id in range(num_blocks)]
        self.free_block_ids: deque[int] = deque(range(num_blocks))
        self._tables: dict[str, list[int]] = {}

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_block_ids)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self.free_block_ids)

    @property
    def tables(self) -> Mapping[str, list[int]]:
        return self._tables

    def num_blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def num_blocks_needed(self, seq_id: str, num_tokens: int) -> int:
        """Blocks that `allocate(seq_id, num_tokens)` would take from the free list."""
        table = self._tables.get(seq_id)
        held = len(table) if table is not None else 0
        return max(0, self.num_blocks_for(num_tokens) - held)

    def num_free_slots(self, seq_id: str, num_tokens: int) -> int:
        """How many tokens past `num_tokens` the sequence could hold, its blocks plus the free ones."""
        table = self._tables.get(seq_id)
        held = len(table) if table is not None else 0
        return (held + len(self.free_block_ids)) * self.block_size - num_tokens

    def block_table(self, seq_id: str) -> list[int]:
        return self._tables.get(seq_id, [])

    def allocate(self, seq_id: str, num_tokens: int) -> list[int] | None:
        """Grow (or create) the sequence's table to cover `num_tokens` slots; None if the pool can't."""
        needed = self.num_blocks_needed(seq_id, num_tokens)
        if needed > len(self.free_block_ids):
            return None
        table = self._tables.setdefault(seq_id, [])
        for _ in range(needed):
            block = self.blocks[self.free_block_ids.pop()]
            block.ref_cnt += 1
            table.append(block.block_id)
        return table

    def free(self, seq_id: str) -> None:
        """Release every block of the sequence's table (a no-op for a sequence without one)."""
        table = self._tables.pop(seq_id, None)
        if table is None:
            return
        # Newest blocks go back last so they are handed out first: still warm in the CPU caches.
        for block_id in table:
            block = self.blocks[block_id]
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self.free_block_ids.append(block_id)
