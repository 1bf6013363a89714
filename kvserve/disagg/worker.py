"""An engine process that can export and import prompt KV (one of a prefill/decode pair).

It is ``ipc/engine_proc.py``'s loop (``EngineLoop``: requests, aborts, steps, stats over
the one codec) plus the messages of ``ipc/kv_messages.py``:

    QueryCachedBlocks  -> CachedBlocks     full blocks of a prompt its prefix cache holds
    ExportOnFinish     -> KVExported       after the step that ends the request (or at its
                                           abort / refusal), its prompt's cached blocks go
                                           out through the KVTransfer; always answered once
    ImportKV           -> KVImported       blocks in from the KVTransfer, into the cache
    CheckIntegrity     -> IntegrityReport

An export runs right after the step that finished its request, before any other step, so
the blocks it reads cannot have been evicted in between. Started as
``python -m kvserve.disagg.worker --fd N``; AttachTransfer (after EngineReady, whose
``kv_layout`` the driver sizes the transfer from) maps the ``KVTransfer``.
"""
from __future__ import annotations

import logging
import socket
import sys
from dataclasses import dataclass

from kvserve.disagg.transfer import KVTransfer, TransferTicket, attach_transfer
from kvserve.engine.request import EngineRequest
from kvserve.errors import KVServeError
from kvserve.ipc import codec, kv_messages as km
from kvserve.ipc.engine_proc import EngineLoop, run_engine_process

logger = logging.getLogger("kvserve.disagg.worker")


@dataclass
class _PendingExport:
    order: km.ExportOnFinish
    request: EngineRequest | None = None      # set when the request arrives


class DisaggEngineLoop(EngineLoop):
    """EngineLoop that also answers the KV transfer messages."""

    def __init__(self, engine, sock: socket.socket):
        super().__init__(engine, sock)
        self.transfer: KVTransfer | None = None           # set by AttachTransfer
        self.exports: dict[str, _PendingExport] = {}      # request id -> export to run when it ends

    # ------------------------------------------------------------- messages
    def handle(self, message) -> None:
        if isinstance(message, km.AttachTransfer):
            self.transfer = attach_transfer(message.description)
        elif isinstance(message, km.QueryCachedBlocks):
            try:
                num = self.engine.cached_prompt_blocks(message.token_ids, message.adapter_id, message.cache_salt)
            except KVServeError:          # an unknown adapter: the request itself will be refused
                num = 0
            self.send(km.CachedBlocks(message.query_id, num))
        elif isinstance(message, km.ExportOnFinish):
            self.exports[message.request_id] = _PendingExport(message)
        elif isinstance(message, km.ImportKV):
            self.send(self._import(message))
        elif isinstance(message, km.CheckIntegrity):
            self.send(self.integrity_report())
        else:
            super().handle(message)
            if isinstance(message, codec.AbortRequests):
                for request_id in message.request_ids:
                    if request_id in self.exports:
                        self._finish_export(request_id, aborted=True)

    def _add(self, request: EngineRequest) -> None:
        export = self.exports.get(request.request_id)
        if export is not None:
            export.request = request
        super()._add(request)
        if export is not None and self.engine.request_status(request.request_id) is None:
            self._finish_export(request.request_id)       # refused: send what is cached, if anything

    # ----------------------------------------------------------------- step
    def step(self) -> None:
        super().step()
        ended = [rid for rid, e in self.exports.items()
                 if e.request is not None and self.engine.request_status(rid) is None]
        for request_id in ended:
            self._finish_export(request_id)

    # --------------------------------------------------------- export/import
    def _finish_export(self, request_id: str, aborted: bool = False) -> None:
        """Send the ended request's cached prompt blocks; answer KVExported either way."""
        export = self.exports.pop(request_id)
        order, num = export.order, 0
        if not aborted and export.request is not None:
            request = export.request
            try:
                hashes, kv = self.engine.export_prompt_kv(request.prompt_token_ids, request.adapter_id,
                                                          request.cache_salt, order.first_block)
                num = min(len(hashes), len(order.slots))
                if num:
                    self.transfer.send(TransferTicket(order.transfer_id, tuple(order.slots)), hashes[:num],
                                       kv[:, :, :num])
            except Exception:             # a cache the transport cannot move: decode computes it
                logger.exception("export of %s failed", request_id)
                num = 0
        self.send(km.KVExported(request_id, order.transfer_id, num, aborted))

    def _import(self, message: km.ImportKV) -> km.KVImported:
        """Blocks from the transfer into the prefix cache; every outcome is answered."""
        num = message.num_blocks
        try:
            hashes, kv = self.transfer.receive(TransferTicket(message.transfer_id, tuple(message.slots)), num)
            result = self.engine.import_prompt_kv(message.token_ids, message.adapter_id, message.cache_salt,
                                                  message.first_block, hashes, kv, message.grace_s)
        except Exception:
            logger.exception("import for %s failed", message.request_id)
            return km.KVImported(message.request_id, message.transfer_id, num, 0, 0, num)
        return km.KVImported(message.request_id, message.transfer_id, result.num_offered, result.num_imported,
                             result.num_present, result.num_dropped)

    def integrity_report(self) -> km.IntegrityReport:
        """Check the engine's block accounting now (between steps)."""
        error = ""
        try:
            self.engine.check_integrity()
        except AssertionError as exc:
            error = str(exc) or "integrity check failed"
        pool = self.engine.block_pool
        return km.IntegrityReport(not error, error, pool.num_blocks, pool.num_free_blocks,
                                  pool.num_cached_only_blocks, pool.num_used_blocks, len(self.exports))


def main(argv: list[str] | None = None) -> int:
    return run_engine_process(argv, "kvserve disaggregated engine process", "disagg engine", "WARNING",
                              make_loop=DisaggEngineLoop)


if __name__ == "__main__":
    sys.exit(main())
