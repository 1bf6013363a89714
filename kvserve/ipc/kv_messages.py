"""Codec messages for moving prompt KV between engine processes (kvserve/disagg/).

The KV itself never crosses the socket: these messages name a transfer (its id and the
transport's slots) and the prompt the blocks belong to; the tensors go through the
``KVTransfer`` (shared memory on one host). Driver -> engine: AttachTransfer (once, after EngineReady), QueryCachedBlocks,
ExportOnFinish (before the prefill's EngineRequest), ImportKV (before the decode's
EngineRequest), CheckIntegrity. Engine -> driver: CachedBlocks, KVExported, KVImported,
IntegrityReport, each answering exactly one of those, in order.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass
class AttachTransfer:
    """Map the KV transfer ``KVTransfer.describe()`` describes (its layout is the one this
    engine reported in EngineReady.kv_layout)."""

    description: dict


@dataclass
class QueryCachedBlocks:
    """How many leading full blocks of this prompt does your prefix cache hold?"""

    query_id: str
    token_ids: list[int]
    adapter_id: str | None = None
    cache_salt: str | None = None


@dataclass
class CachedBlocks:
    """The answer to QueryCachedBlocks."""

    query_id: str
    num_blocks: int


@dataclass
class ExportOnFinish:
    """When request ``request_id`` (sent next) ends, send its prompt's cached full blocks
    from ``first_block`` on through the transfer's ``slots`` (at most ``len(slots)``)."""

    request_id: str
    transfer_id: str
    slots: list[int]
    first_block: int


@dataclass
class KVExported:
    """The answer to ExportOnFinish, once per transfer: ``num_blocks`` sent (0 when the
    request was aborted first, ``aborted`` True). After it the engine never touches the
    transfer's slots again."""

    request_id: str
    transfer_id: str
    num_blocks: int
    aborted: bool = False


@dataclass
class ImportKV:
    """Take ``num_blocks`` blocks (prompt blocks ``[first_block, first_block + num_blocks)``)
    from the transfer's slots into your prefix cache, protected ``grace_s`` seconds."""

    request_id: str
    transfer_id: str
    slots: list[int]
    first_block: int
    num_blocks: int
    token_ids: list[int]
    adapter_id: str | None = None
    cache_salt: str | None = None
    grace_s: float = 0.0


@dataclass
class KVImported:
    """The answer to ImportKV (KVImportResult's counts). After it the engine never
    touches the transfer's slots again."""

    request_id: str
    transfer_id: str
    num_offered: int
    num_imported: int
    num_present: int
    num_dropped: int


@dataclass
class CheckIntegrity:
    """Check block-pool and prefix-cache integrity now (answered by IntegrityReport)."""


@dataclass
class IntegrityReport:
    """The engine's block accounting and whether its integrity check passed."""

    ok: bool
    error: str
    num_blocks: int
    num_free_blocks: int
    num_cached_only_blocks: int
    num_used_blocks: int
    num_pending_exports: int


KV_MESSAGES = (AttachTransfer, QueryCachedBlocks, CachedBlocks, ExportOnFinish, KVExported, ImportKV, KVImported, CheckIntegrity,
               IntegrityReport)
