"""Prefix-cache keys, block hashes and the events published for a cache-aware router.

Pure Python, no torch. A block's hash chains its parent's hash with its own token
ids; the chain starts from a seed derived from the namespace, so the same tokens
under another adapter, weight epoch or cache salt hash differently. Hashes use
SHA-256 (truncated to 63 bits), never Python's ``hash``: a router in another
process must compute the same values.
"""
from __future__ import annotations

import hashlib
from array import array
from dataclasses import dataclass


@dataclass(frozen=True)
class CacheNamespace:
    """What must be equal for two requests to share KV blocks.

    ``adapter_id``: the LoRA adapter (None = base weights). ``weight_epoch``: bumped
    when weights are reloaded, so KV of older weights is never matched again.
    ``cache_salt``: derived by the server from the authenticated caller (API key or
    tenant), never taken from a request body as-is, so tenants never share KV.
    """

    adapter_id: str | None = None
    weight_epoch: int = 0
    cache_salt: str | None = None


def namespace_seed(namespace: CacheNamespace) -> int:
    """The parent hash of a namespace's first block."""
    text = repr((namespace.adapter_id, namespace.weight_epoch, namespace.cache_salt))
    return _digest(b"kvserve-prefix-root\0" + text.encode())


def block_hash(parent_hash: int, token_ids: list[int]) -> int:
    """Hash of one full block: its parent's hash chained with its token ids."""
    return _digest(parent_hash.to_bytes(8, "little") + array("q", token_ids).tobytes())


def _digest(data: bytes) -> int:
    return int.from_bytes(hashlib.sha256(data).digest()[:8], "little") >> 1


@dataclass(frozen=True)
class BlockStored:
    """Blocks that entered the cache: consecutive full blocks, ``token_ids`` holding
    ``len(block_hashes) * block_size`` tokens; the first block's parent is
    ``parent_block_hash`` (None for the first block of a namespace)."""

    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    adapter_id: str | None


@dataclass(frozen=True)
class BlockRemoved:
    """Blocks that left the cache (evicted or reset)."""

    block_hashes: list[int]


CacheEvent = BlockStored | BlockRemoved


def prompt_block_hashes(namespace: CacheNamespace, token_ids: list[int], block_size: int) -> list[int]:
    """The chained hashes of a prompt's full blocks (the last token never included, as the
    prefix cache matches), equal to those the cache gives the same blocks: what two
    engines compare to agree on which KV blocks they mean."""
    hashes, previous = [], namespace_seed(namespace)
    for start in range(0, (len(token_ids) - 1) // block_size * block_size, block_size):
        previous = block_hash(previous, list(token_ids[start:start + block_size]))
        hashes.append(previous)
    return hashes
