"""KV-cache sizing: the one formula shared by the engine's memory sizing and the planner.

bytes per token = 2 (K and V) x layers x kv_heads x (head_dim x element bytes + scale
bytes), where the 8-bit formats keep one fp32 scale per (token, kv head) and the float
formats none. Pure Python.
"""
from __future__ import annotations

from dataclasses import dataclass
from types import MappingProxyType


@dataclass(frozen=True)
class KVStorage:
    """How one KV element is stored: ``element_bytes`` per value plus ``scale_bytes``
    per (token, kv head) (0 for the float formats)."""

    element_bytes: float
    scale_bytes: float = 0.0


SCALE_BYTES = 4.0    # one fp32 scale per (token, kv head) in the 8-bit formats

# KV storage by the engine's KV dtype name (``ResolvedConfig.kv_cache_dtype``).
KV_STORAGE = MappingProxyType({
    "float64": KVStorage(8.0),
    "float32": KVStorage(4.0),
    "bfloat16": KVStorage(2.0),
    "float16": KVStorage(2.0),
    "int8": KVStorage(1.0, SCALE_BYTES),
    "fp8_e4m3": KVStorage(1.0, SCALE_BYTES),
    "fp8_e5m2": KVStorage(1.0, SCALE_BYTES),
})


def kv_storage(kv_dtype: str) -> KVStorage:
    """Element and scale bytes of the KV dtype called ``kv_dtype`` (e.g. "float32", "int8")."""
    if kv_dtype not in KV_STORAGE:
        raise ValueError(f"unknown KV dtype {kv_dtype!r}; choose from {sorted(KV_STORAGE)}")
    return KV_STORAGE[kv_dtype]


def kv_bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, dtype_bytes: float,
                       scale_bytes: float = 0.0) -> float:
    """Bytes of KV cache one token occupies across all layers (K and V), scales included."""
    if min(num_layers, num_kv_heads, head_dim) <= 0 or dtype_bytes <= 0 or scale_bytes < 0:
        raise ValueError("layers, kv_heads, head_dim and dtype_bytes must be positive, scale_bytes >= 0")
    return 2 * num_layers * num_kv_heads * (head_dim * dtype_bytes + scale_bytes)


def describe_bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, dtype_bytes: float,
                             scale_bytes: float = 0.0) -> str:
    """``2 x 30 layers x 3 kv_heads x (64 head_dim x 1 B + 4 B scale) = 12,240 B``."""
    per_token = kv_bytes_per_token(num_layers, num_kv_heads, head_dim, dtype_bytes, scale_bytes)
    element = f"{head_dim} head_dim x {dtype_bytes:g} B"
    if scale_bytes:
        element = f"({element} + {scale_bytes:g} B scale per (token, kv_head))"
    return f"2 x {num_layers} layers x {num_kv_heads} kv_heads x {element} = {per_token:,.0f} B"


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
                  dtype_bytes: float, block_size: int, max_context: int,
                  scale_bytes: float = 0.0) -> KVCachePlan:
    """Split ``budget_bytes`` of KV memory into ``block_size``-token blocks.

    ``max_seqs_at_full_context`` counts sequences of ``max_context`` tokens that fit at once;
    ``scale_bytes`` is per (token, kv head) (the 8-bit formats' scales).
    """
    per_token = kv_bytes_per_token(num_layers, num_kv_heads, head_dim, dtype_bytes, scale_bytes)
    per_block = per_token * block_size
    num_blocks = int(budget_bytes // per_block)
    max_tokens = num_blocks * block_size
    blocks_per_seq = -(-max_context // block_size)
    max_seqs = num_blocks // blocks_per_seq if blocks_per_seq else 0
    explanation = (
        f"KV bytes/token = {describe_bytes_per_token(num_layers, num_kv_heads, head_dim, dtype_bytes, scale_bytes)}; "
        f"block = {block_size} tokens = {per_block:,.0f} B; "
        f"budget {budget_bytes / 2**20:,.1f} MiB -> {num_blocks} blocks = {max_tokens:,} tokens; "
        f"at full context {max_context:,} ({blocks_per_seq} blocks/seq) -> {max_seqs} concurrent sequences"
    )
    return KVCachePlan(per_token, block_size, per_block, num_blocks, max_tokens, max_seqs, explanation)
