"""How single-token (decode) sequences are batched into attention kernels: one rule,
used by the model runner and by the planner's step-time model. Pure Python."""
from __future__ import annotations

from typing import Sequence

MAX_PADDING_RATIO = 1.25          # padded blocks may exceed the group's real blocks by 25% ...
PADDING_SLACK_BLOCKS = 4          # ... plus this many blocks per sequence


def decode_groups(context_lens: Sequence[int], block_size: int) -> list[list[int]]:
    """Indices into ``context_lens``, sorted by context length and cut into groups whose
    padded size (``len(group) x`` the longest member's blocks) exceeds the members' real
    blocks by at most 25% plus 4 blocks per member. Each group is one batched kernel
    reading ``len(group) x ceil(longest / block_size)`` blocks."""
    order = sorted(range(len(context_lens)), key=lambda i: context_lens[i])
    groups: list[list[int]] = []
    current: list[int] = []
    real_blocks = 0
    for i in order:
        blocks = -(-context_lens[i] // block_size)          # the longest so far: sorted
        candidate_real = real_blocks + blocks
        padded = (len(current) + 1) * blocks
        if current and padded > MAX_PADDING_RATIO * candidate_real + PADDING_SLACK_BLOCKS * (len(current) + 1):
            groups.append(current)
            current, candidate_real = [], blocks
        current.append(i)
        real_blocks = candidate_real
    if current:
        groups.append(current)
    return groups
