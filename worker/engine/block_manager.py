"""The KV cache's bookkeeping: a pool of fixed-size blocks and one block table per sequence.

Pure Python: it hands out block ids; the model runner owns the tensors they index.

Prefix caching: a full block whose K/V are computed is registered under a hash of its tokens and
of every token before it. A new sequence whose prompt starts with registered blocks takes them
(ref_cnt += 1) instead of recomputing them. Freed blocks keep their hash while they wait on the
free list, least recently freed first out, so a preempted or repeated prefix is often still there.

Cache salts (vLLM's `cache_salt`): a salted sequence's first block hashes under a root made from
its salt instead of the shared root. Every later block chains its parent's hash, so two requests
share blocks only when their salts are equal (or both absent): a tenant cannot probe another's
cached prompts by timing or by `cached_tokens`.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping
from collections.abc import Sequence as Seq
from dataclasses import dataclass

_ROOT_HASH = -1  # the parent of a sequence's first block; CPython never returns -1 from hash()


@dataclass(slots=True)
class Block:
    block_id: int
    ref_cnt: int = 0  # tables holding this block; 0 means it is on the free list
    block_hash: int | None = None  # set once full and computed: its key in the prefix cache


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be at least 1, got {num_blocks}")
        if block_size < 1:
            raise ValueError(f"block_size must be at least 1, got {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(block_id) for block_id in range(num_blocks)]
        # An ordered dict rather than a deque: a prefix hit takes a block out of the middle, in O(1).
        self.free_block_ids: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self.cached_block_ids: dict[int, int] = {}  # block_hash -> block_id
        self._tables: dict[str, list[int]] = {}
        self._num_hashed: dict[str, int] = {}  # leading blocks of a table already registered

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
            block_id, _ = self.free_block_ids.popitem(last=False)
            block = self.blocks[block_id]
            if block.block_hash is not None:  # evict the least recently freed cached block
                if self.cached_block_ids.get(block.block_hash) == block_id:
                    del self.cached_block_ids[block.block_hash]
                block.block_hash = None
            block.ref_cnt = 1
            table.append(block_id)
        return table

    def allocate_cached_prefix(self, seq_id: str, token_ids: Seq[int],
                               cache_salt: str | None = None) -> int:
        """Start the sequence's table with its cached leading blocks; return the tokens they hold.

        The last token is never taken from the cache: its forward pass gives the next logits.
        Only blocks cached under the same `cache_salt` (None: unsalted) are found.
        """
        if seq_id in self._tables:
            raise ValueError(f"sequence {seq_id!r} already has a block table")
        table: list[int] = []
        if self.enable_prefix_caching:
            parent = _chain_root(cache_salt)
            for index in range((len(token_ids) - 1) // self.block_size):
                parent = self._hash(parent, token_ids, index)
                block_id = self.cached_block_ids.get(parent)
                if block_id is None:
                    break
                block = self.blocks[block_id]
                if block.ref_cnt == 0:
                    del self.free_block_ids[block_id]
                block.ref_cnt += 1
                table.append(block_id)
        if table:
            self._tables[seq_id] = table
            self._num_hashed[seq_id] = len(table)
        return len(table) * self.block_size

    def cache_computed_blocks(self, seq_id: str, token_ids: Seq[int], num_computed_tokens: int,
                              cache_salt: str | None = None) -> None:
        """Register the sequence's blocks that are now full and computed, for later prefix hits
        by sequences of the same `cache_salt` (give the one given to allocate_cached_prefix)."""
        if not self.enable_prefix_caching:
            return
        table = self._tables.get(seq_id)
        if table is None:
            return
        done = self._num_hashed.get(seq_id, 0)
        full = min(num_computed_tokens // self.block_size, len(table))
        if full <= done:
            return
        parent = self.blocks[table[done - 1]].block_hash if done else _chain_root(cache_salt)
        for index in range(done, full):
            parent = self._hash(parent, token_ids, index)
            block = self.blocks[table[index]]
            block.block_hash = parent
            # The first block computed for a hash stays its cache entry; a twin is just not shared.
            self.cached_block_ids.setdefault(parent, block.block_id)
        self._num_hashed[seq_id] = full

    def free(self, seq_id: str) -> None:
        """Release every block of the sequence's table (a no-op for a sequence without one)."""
        table = self._tables.pop(seq_id, None)
        self._num_hashed.pop(seq_id, None)
        if table is None:
            return
        # Tail first: a sequence's last blocks are the least likely to be shared, so evict them first.
        for block_id in reversed(table):
            block = self.blocks[block_id]
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                if block.block_hash is None or self.cached_block_ids.get(block.block_hash) != block_id:
                    block.block_hash = None  # nobody can find it: hand it out before cached ones
                    self.free_block_ids[block_id] = None
                    self.free_block_ids.move_to_end(block_id, last=False)
                else:
                    self.free_block_ids[block_id] = None

    def _hash(self, parent: int | None, token_ids: Seq[int], index: int) -> int:
        # Python's tuple-of-int hash is 64-bit and unsalted: a collision (which would share wrong
        # K/V) needs two distinct prefixes to meet in 2**64, which we accept, as vLLM does by default.
        start = index * self.block_size
        return hash((parent, *token_ids[start : start + self.block_size]))


def _chain_root(cache_salt: str | None) -> int:
    """The parent hash of a sequence's first block. A salt roots a chain of its own: mixing it
    into the first block alone isolates every later one, which chains its parent's hash. Hashing
    a (str, str) tuple never yields -1, so no salt ever maps onto the unsalted root; str hashes
    are keyed per process (PYTHONHASHSEED), so a client cannot aim a salt at another's root."""
    if cache_salt is None:
        return _ROOT_HASH
    return hash(("cache_salt", cache_salt))
