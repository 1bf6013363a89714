"""Attention backends, chosen by name (``"torch"`` runs anywhere)."""
from __future__ import annotations

from kvserve.attention.metadata import AttentionMetadata, DecodeGroup, PrefillChunk
from kvserve.attention.torch_paged import TorchPagedAttention

BACKENDS = {"torch": TorchPagedAttention}


def get_backend(name: str, num_heads: int, num_kv_heads: int, head_dim: int):
    """Build the attention backend ``name``."""
    if name not in BACKENDS:
        raise ValueError(f"unknown attention backend {name!r}; choose from {sorted(BACKENDS)}")
    return BACKENDS[name](num_heads, num_kv_heads, head_dim)


__all__ = ["AttentionMetadata", "DecodeGroup", "PrefillChunk", "get_backend"]
