"""Block pool: KV block ids, reference counts and a free list. No tensors.

The pool hands out block ids; the KV tensors they index live in the runner.
"Cannot allocate" is a return value (``None``) that the scheduler answers with
preemption. Exceptions are raised only for broken invariants (double free).
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
        self._ref_counts = [0] * num_blocks
        self._free = deque(range(num_blocks))

    @property
    def num_free_blocks(self) -> int:
        """Blocks with reference count zero."""
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        """Blocks referenced by at least one sequence."""
        return self.num_blocks - len(self._free)

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
        """Add one reference to each of ``block_ids`` (a new sequence shares them)."""
        for block_id in block_ids:
            if self._ref_counts[block_id] <= 0:
                raise RuntimeError(f"share of free block {block_id}")
            self._ref_counts[block_id] += 1

    def free(self, block_ids: list[int]) -> None:
        """Drop one reference to each block; blocks reaching zero return to the free list."""
        for block_id in block_ids:
            count = self._ref_counts[block_id]
            if count <= 0:
                raise RuntimeError(f"double free of block {block_id}")
            self._ref_counts[block_id] = count - 1
            if count == 1:
                self._free.append(block_id)

    def ref_count(self, block_id: int) -> int:
        """Current number of references to ``block_id``."""
        return self._ref_counts[block_id]

    def check_integrity(self, held_block_ids: list[list[int]] | None = None) -> None:
        """Assert free + used == total; with the block tables of all live sequences,
        also that every block's ref count equals the number of tables holding it."""
        free_set = set(self._free)
        if len(free_set) != len(self._free):
            raise AssertionError("free list holds a block twice")
        for block_id, count in enumerate(self._ref_counts):
            if (count == 0) != (block_id in free_set):
                raise AssertionError(f"block {block_id}: ref count {count} vs free list")
        if self.num_free_blocks + self.num_used_blocks != self.num_blocks:
            raise AssertionError("free + used != total")
        if held_block_ids is not None:
            expected = [0] * self.num_blocks
            for table in held_block_ids:
                for block_id in table:
                    expected[block_id] += 1
            if expected != self._ref_counts:
                leaked = [b for b in range(self.num_blocks) if expected[b] != self._ref_counts[b]]
                raise AssertionError(f"ref counts disagree with block tables for blocks {leaked[:10]}")
