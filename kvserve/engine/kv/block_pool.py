"""Block pool: KV block ids, reference counts and a free list. No tensors.

The pool hands out block ids; the KV tensors they index live in the runner.
"Cannot allocate" is a return value (``None``) that the scheduler answers with
eviction from the prefix cache, then preemption. Exceptions are raised only for
broken invariants (double free).

Every block is in exactly one of three states::

    free         ref count 0, on the free list
    cached-only  held by the prefix cache alone (one reference): reclaimable by eviction
    in use       held by at least one sequence (and maybe also by the prefix cache)

The prefix cache's reference is flagged per block (``cache_blocks`` / ``uncache_blocks``)
so that "in use" counts sequences only: ``num_used_blocks`` is 0 when no request runs,
whatever the cache holds.
"""
from __future__ import annotations

from collections import deque


class BlockPool:
    """A fixed set of ``num_blocks`` KV blocks of ``block_size`` tokens each."""

    def __init__(self, num_blocks: int, block_size: int):
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError("num_blocks and block_size must be positive")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._ref_counts = [0] * num_blocks          # sequence references + 1 if cached
        self._cached = [False] * num_blocks          # the prefix cache holds one reference
        self._free = deque(range(num_blocks))
        self._num_cached_blocks = 0
        self._num_cached_only_blocks = 0

    @property
    def num_free_blocks(self) -> int:
        """Blocks with reference count zero."""
        return len(self._free)

    @property
    def num_cached_blocks(self) -> int:
        """Blocks the prefix cache holds a reference on (in use by sequences or not)."""
        return self._num_cached_blocks

    @property
    def num_cached_only_blocks(self) -> int:
        """Blocks held by the prefix cache alone: evicting them frees them."""
        return self._num_cached_only_blocks

    @property
    def num_used_blocks(self) -> int:
        """Blocks referenced by at least one sequence (cached-only blocks excluded)."""
        return self.num_blocks - len(self._free) - self._num_cached_only_blocks

    def blocks_for_tokens(self, num_tokens: int) -> int:
        """Blocks needed to hold ``num_tokens`` tokens."""
        return -(-num_tokens // self.block_size)

    def allocate(self, num_blocks: int) -> list[int] | None:
        """Take ``num_blocks`` free blocks (ref count 1 each), or ``None`` if too few are free."""
        if num_blocks > len(self._free):
            return None
        blocks = [self._free.popleft() for _ in range(num_blocks)]
        for block_id in blocks:
            self._ref_counts[block_id] = 1
        return blocks

    def share(self, block_ids: list[int]) -> None:
        """Add one sequence reference to each of ``block_ids`` (a sequence starts using
        blocks another sequence or the prefix cache holds)."""
        for block_id in block_ids:
            count = self._ref_counts[block_id]
            if count <= 0:
                raise RuntimeError(f"share of free block {block_id}")
            if count == 1 and self._cached[block_id]:
                self._num_cached_only_blocks -= 1
            self._ref_counts[block_id] = count + 1

    def free(self, block_ids: list[int]) -> None:
        """Drop one sequence reference to each block; blocks reaching zero return to the
        free list, cached blocks losing their last sequence become cached-only."""
        for block_id in block_ids:
            count = self._ref_counts[block_id]
            cached = self._cached[block_id]
            if count - cached <= 0:
                raise RuntimeError(f"double free of block {block_id}")
            self._ref_counts[block_id] = count - 1
            if count == 1:
                self._free.append(block_id)
            elif count == 2 and cached:
                self._num_cached_only_blocks += 1

    def cache_blocks(self, block_ids: list[int]) -> None:
        """The prefix cache takes its one reference on each of ``block_ids`` (blocks a
        sequence holds and has fully computed)."""
        for block_id in block_ids:
            if self._ref_counts[block_id] <= 0 or self._cached[block_id]:
                raise RuntimeError(f"cache of block {block_id}: free or already cached")
            self._cached[block_id] = True
            self._ref_counts[block_id] += 1
            self._num_cached_blocks += 1

    def uncache_blocks(self, block_ids: list[int]) -> int:
        """The prefix cache drops its reference on each of ``block_ids``; returns how
        many of them became free (the others are still used by sequences)."""
        num_freed = 0
        for block_id in block_ids:
            if not self._cached[block_id]:
                raise RuntimeError(f"uncache of block {block_id}: not cached")
            self._cached[block_id] = False
            self._num_cached_blocks -= 1
            count = self._ref_counts[block_id] - 1
            self._ref_counts[block_id] = count
            if count == 0:
                self._num_cached_only_blocks -= 1
                self._free.append(block_id)
                num_freed += 1
        return num_freed

    def ref_count(self, block_id: int) -> int:
        """Current number of references to ``block_id`` (the cache's included)."""
        return self._ref_counts[block_id]

    def is_cached(self, block_id: int) -> bool:
        """Whether the prefix cache holds a reference on ``block_id``."""
        return self._cached[block_id]

    def check_integrity(self, held_block_ids: list[list[int]] | None = None) -> None:
        """Assert free + cached-only + in use == total and that the counters match the
        per-block state; with the block tables of all live sequences, also that every
        block's ref count equals the number of tables holding it (+1 if cached)."""
        free_set = set(self._free)
        if len(free_set) != len(self._free):
            raise AssertionError("free list holds a block twice")
        cached_only = 0
        for block_id, count in enumerate(self._ref_counts):
            if (count == 0) != (block_id in free_set):
                raise AssertionError(f"block {block_id}: ref count {count} vs free list")
            if self._cached[block_id] and count < 1:
                raise AssertionError(f"block {block_id}: cached with ref count {count}")
            cached_only += self._cached[block_id] and count == 1
        if cached_only != self._num_cached_only_blocks or sum(self._cached) != self._num_cached_blocks:
            raise AssertionError("cached block counters disagree with the per-block state")
        in_use = sum(1 for b, c in enumerate(self._ref_counts) if c - self._cached[b] > 0)
        if self.num_free_blocks + cached_only + in_use != self.num_blocks or in_use != self.num_used_blocks:
            raise AssertionError("free + cached-only + in use != total")
        if held_block_ids is not None:
            expected = [int(cached) for cached in self._cached]
            for table in held_block_ids:
                for block_id in table:
                    expected[block_id] += 1
            if expected != self._ref_counts:
                leaked = [b for b in range(self.num_blocks) if expected[b] != self._ref_counts[b]]
                raise AssertionError(f"ref counts disagree with block tables for blocks {leaked[:10]}")
