"""Per-forward attention metadata, built once per step by the runner and shared by all layers.

The flat token batch is split into two groups:

    tokens: [ p0 p0 p0 | d1 | p2 p2 | d3 | d4 ]      p = multi-token chunk, d = single decode token
    decode groups -> one batched call per group of similar context lengths
    prefill group -> one call per chunk, causal within the chunk

Positions ``[start, start + n)`` of a chunk attend to cache positions ``[0, start + i]``.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class PrefillChunk:
    """A multi-token chunk of one sequence."""

    token_start: int          # first row of this chunk in the flat batch
    num_tokens: int
    start_position: int       # tokens already in the cache before this chunk
    block_ids: torch.Tensor   # [num_blocks] int64, covering start_position + num_tokens
    mask: torch.Tensor | None # [num_tokens, context_len] bool, True = attend; None = plain causal (start 0)


@dataclass
class DecodeGroup:
    """Sequences computing exactly one token this step, padded to the group's longest.

    Decodes are sorted by context length and cut into groups so that padding stays small.
    """

    token_index: torch.Tensor    # [D] int64 rows in the flat batch
    block_ids: torch.Tensor      # [D * max_blocks] int64, each row's table padded with block 0
    max_blocks: int
    mask: torch.Tensor           # [D, 1, 1, max_blocks * block_size] bool, True = attend


@dataclass
class AttentionMetadata:
    """Everything attention needs for one forward pass; passed explicitly, never global."""

    slot_mapping: torch.Tensor                    # [T] int64 cache slot of each token
    prefills: list[PrefillChunk] = field(default_factory=list)
    decode_groups: list[DecodeGroup] = field(default_factory=list)
