"""KV-cache sizing: the one formula shared by the engine's memory sizing and the planner.

bytes per token = 2 (K and V) x layers x kv_heads x head_dim x dtype bytes. Pure Python.
"""
from __future__ import annotations

from dataclasses import dataclass


def kv_bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, dtype_bytes: float) -> float:
    """Bytes of KV cache one token occupies across all layers (K and V)."""
    if min(num_layers, num_kv_heads, head_dim) <= 0 or dtype_bytes <= 0:
        raise ValueError("layers, kv_heads, head_dim and dtype_bytes must be positive")
    return 2 * num_layers * num_kv_heads * head_dim * dtype_bytes


@dataclass(frozen=True)
class KVCachePlan:
    """How a KV memory budget splits into blocks, with the arithmetic that produced it."""

    bytes_per_token: float
    block_size: int
    bytes_per_block: float
    num_blocks: int
    max_tokens: int
    max_seqs_at_full_context: int
    explanation: str


def kv_cache_plan(budget_bytes: float, num_layers: int, num_kv_heads: int, head_dim: int,
                  dtype_bytes: float, block_size: int, max_context: int) -> KVCachePlan:
    """Split ``budget_bytes`` of KV memory into ``block_size``-token blocks.

    ``max_seqs_at_full_context`` counts sequences of ``max_context`` tokens that fit at once.
    """
    per_token = kv_bytes_per_token(num_layers, num_kv_heads, head_dim, dtype_bytes)
    per_block = per_token * block_size
    num_blocks = int(budget_bytes // per_block)
    max_tokens = num_blocks * block_size
    blocks_per_seq = -(-max_context // block_size)
    max_seqs = num_blocks // blocks_per_seq if blocks_per_seq else 0
    explanation = (
        f"KV bytes/token = 2 x {num_layers} layers x {num_kv_heads} kv_heads x {head_dim} head_dim "
        f"x {dtype_bytes:g} B = {per_token:,.0f} B; block = {block_size} tokens = {per_block:,.0f} B; "
        f"budget {budget_bytes / 2**20:,.1f} MiB -> {num_blocks} blocks = {max_tokens:,} tokens; "
        f"at full context {max_context:,} ({blocks_per_seq} blocks/seq) -> {max_seqs} concurrent sequences"
    )
    return KVCachePlan(per_token, block_size, per_block, num_blocks, max_tokens, max_seqs, explanation)
