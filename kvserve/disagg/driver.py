"""The disaggregated front end: a prefill engine process, a decode engine process, one
``KVTransfer`` between them, and the per-request rule (``rule.py``).

Each request goes through these stages (the driver is the only one that moves it)::

    QUERYING ── CachedBlocks ──▶ unified ─────────────────────────────────▶ DECODING
        │         (decode's hits)                                            ▲
        └──▶ STAGING (wait for transfer room) ──▶ PREFILLING ── KVExported ─┤ 0 blocks
                                                    │                        │
                                                    └──▶ IMPORTING ── KVImported
                                                         (ImportKV + request sent to decode)

Prefill: the prompt runs on the prefill engine with ``max_tokens=1`` and its cached full
blocks ``[first_block, end_block)`` go out when it ends (first_block = what the decode
engine already caches: those never move). Decode: the blocks enter its prefix cache under
the same block hashes, then the request itself arrives and finds them as a prefix hit, so
it computes only the last partial block and samples: outputs are those of a unified
engine. Transfer room is released only once the engine that may touch it has answered
(KVExported / KVImported), so an abort at any stage leaves both engines and the staging
area exact.
"""
from __future__ import annotations

import dataclasses
import enum
import itertools
import select
import time
from collections import deque
from dataclasses import dataclass, field

from kvserve.disagg.process import EngineProcess
from kvserve.disagg.rule import Route, RouteDecision, choose_route
from kvserve.disagg.transfer import KVLayout, SharedMemoryTransfer, TransferTicket
from kvserve.engine.request import EngineRequest
from kvserve.engine.step import SeqUpdate
from kvserve.ipc import codec, kv_messages as km
from kvserve.sampling.params import SamplingParams


@dataclass(frozen=True)
class DisaggConfig:
    """``threshold_tokens``: uncached prompt tokens from which a request is prefilled on
    the prefill engine; ``staging_blocks``: transfer room (blocks in flight at once);
    ``import_grace_s``: how long imported blocks are protected from eviction while their
    request waits to be admitted on the decode engine."""

    threshold_tokens: int = 512
    staging_blocks: int = 512
    import_grace_s: float = 30.0


@dataclass
class DisaggCounters:
    """What the driver routed and moved (blocks are KV blocks of block_size tokens)."""

    num_unified: int = 0
    num_disaggregated: int = 0
    num_aborted: int = 0
    blocks_sent: int = 0              # exported by the prefill engine into the transfer
    blocks_received: int = 0          # imported into the decode engine's prefix cache
    blocks_skipped: int = 0           # the decode engine held them already: never sent
    blocks_present_on_import: int = 0  # sent, but cached on the decode side by then
    blocks_dropped: int = 0           # sent, but refused (no room, a gap, another namespace)


class Stage(str, enum.Enum):
    QUERYING = "querying"
    STAGING = "staging"
    PREFILLING = "prefilling"
    IMPORTING = "importing"
    DECODING = "decoding"
    DONE = "done"


@dataclass
class _Tracked:
    request: EngineRequest
    stage: Stage = Stage.QUERYING
    decision: RouteDecision | None = None
    ticket: TransferTicket | None = None
    aborted: bool = False
    outputs: dict[int, list[int]] = field(default_factory=dict)     # sibling -> token ids
    finish_reasons: dict[int, str] = field(default_factory=dict)
    error: dict | None = None


@dataclass(frozen=True)
class DisaggResult:
    """A request's outcome: token ids per sibling, finish reasons (``abort`` if aborted)."""

    request_id: str
    token_ids: list[list[int]]
    finish_reasons: list[str]
    error: dict | None = None


class DisaggregatedEngines:
    """A prefill engine and a decode engine as two processes, driven from this one."""

    def __init__(self, engine_config: dict, config: DisaggConfig = DisaggConfig(),
                 prefill_config: dict | None = None, decode_config: dict | None = None):
        self.config = config
        self.counters = DisaggCounters()
        self.transfer: SharedMemoryTransfer | None = None
        self.prefill: EngineProcess | None = None
        self.decode: EngineProcess | None = None
        self._tracked: dict[str, _Tracked] = {}
        self._waiting_room: deque[str] = deque()
        self._transfer_ids = itertools.count()
        try:
            self._start(engine_config, prefill_config or {}, decode_config or {})
        except BaseException:
            self.close()
            raise

    def _start(self, engine_config: dict, prefill_config: dict, decode_config: dict) -> None:
        """Start both engines (loading in parallel), check they lay KV blocks out alike,
        then give both the staging area sized from that layout."""
        self.decode = EngineProcess("decode", {**engine_config, **decode_config})
        self.prefill = EngineProcess("prefill", {**engine_config, **prefill_config})
        decode_info, prefill_info = self.decode.wait_ready(), self.prefill.wait_ready()
        if not decode_info.kv_layout or decode_info.kv_layout != prefill_info.kv_layout:
            raise ValueError(f"the engines' KV blocks cannot move between them: decode {decode_info.kv_layout}, "
                             f"prefill {prefill_info.kv_layout} (plain float KV, one rank, same model and dtype)")
        self.block_size = decode_info.block_size
        self.transfer = SharedMemoryTransfer(KVLayout(**decode_info.kv_layout), self.config.staging_blocks)
        for engine in (self.prefill, self.decode):
            engine.send(km.AttachTransfer(self.transfer.describe()))
        self.check_integrity()        # answered after the attach: both have mapped the file
        self.transfer.unlink()

    # -------------------------------------------------------------- requests
    def add_request(self, request: EngineRequest) -> None:
        """Route ``request``: ask the decode engine what it caches of the prompt first."""
        if request.request_id in self._tracked:
            raise ValueError(f"request id {request.request_id} is in use")
        self._tracked[request.request_id] = _Tracked(request)
        self.decode.send(km.QueryCachedBlocks(request.request_id, list(request.prompt_token_ids),
                                              request.adapter_id, request.cache_salt))

    def abort(self, request_id: str) -> None:
        """End a request now at whatever stage it is; its transfer room is given back
        as soon as the engine that may touch it has answered."""
        self._end(request_id, count_abort=True)

    def finish(self, request_id: str) -> None:
        """The caller ended the request itself (e.g. the HTTP process matched its stop
        strings and stopped its sequences): end it as ``abort`` does, without counting it
        as aborted. Nothing happens if the driver had already ended it."""
        self._end(request_id, count_abort=False)

    def _end(self, request_id: str, count_abort: bool) -> None:
        tracked = self._tracked.get(request_id)
        if tracked is None or tracked.stage is Stage.DONE or tracked.aborted:
            return
        tracked.aborted = True
        self.counters.num_aborted += 1 if count_abort else 0
        if tracked.stage is Stage.STAGING:
            self._waiting_room.remove(request_id)
            self._finish(tracked)
        elif tracked.stage is Stage.PREFILLING:
            self.prefill.send(codec.AbortRequests([request_id]))
        elif tracked.stage in (Stage.IMPORTING, Stage.DECODING):
            self.decode.send(codec.AbortRequests([request_id]))
            if tracked.stage is Stage.DECODING:
                self._finish(tracked)
        # QUERYING: ended when its answer comes

    def stage(self, request_id: str) -> Stage | None:
        tracked = self._tracked.get(request_id)
        return tracked.stage if tracked is not None else None

    def has_unfinished(self) -> bool:
        return any(t.stage is not Stage.DONE for t in self._tracked.values())

    def poll(self, timeout_s: float = 0.05) -> list[SeqUpdate]:
        """Handle what both engines sent (waiting up to ``timeout_s`` for something);
        the decode engine's updates of live requests."""
        ready, _, _ = select.select([self.prefill, self.decode], [], [], timeout_s)
        updates: list[SeqUpdate] = []
        if self.prefill in ready:
            for message in self.prefill.receive():
                self._on_prefill(message)
        if self.decode in ready:
            for message in self.decode.receive():
                updates += self._on_decode(message)
        return updates

    def on_message(self, engine: EngineProcess, message) -> list[SeqUpdate]:
        """Handle one message ``engine`` (``self.prefill`` or ``self.decode``) sent, for a
        caller that reads the engines' sockets itself instead of calling ``poll``; the
        decode engine's updates of live requests. Messages that are not the driver's
        (stats, cache blocks, control answers, IntegrityReport) are ignored here."""
        if engine is self.prefill:
            self._on_prefill(message)
            return []
        return self._on_decode(message)

    def take_result(self, request_id: str) -> DisaggResult:
        """The outcome of a request that is done; the driver forgets it."""
        tracked = self._tracked[request_id]
        if tracked.stage is not Stage.DONE:
            raise RuntimeError(f"request {request_id} is not done ({tracked.stage.value})")
        del self._tracked[request_id]
        siblings = range(tracked.request.params.n)
        return DisaggResult(request_id, [tracked.outputs.get(s, []) for s in siblings],
                            [tracked.finish_reasons.get(s, "abort") for s in siblings], tracked.error)

    def generate(self, requests: list[EngineRequest]) -> dict[str, DisaggResult]:
        """Run ``requests`` to completion; their results by request id."""
        for request in requests:
            self.add_request(request)
        while self.has_unfinished():
            self.poll()
        return {r.request_id: self.take_result(r.request_id) for r in requests}

    # ------------------------------------------------------- prefill engine
    def _on_prefill(self, message) -> None:
        if isinstance(message, km.KVExported):
            self._on_exported(message)
        # StepOutputs (the prefill's one sampled token), stats, cache blocks and refusals
        # of the prefill engine are not the client's: a refusal still ends in KVExported.

    def _on_exported(self, message: km.KVExported) -> None:
        tracked = self._tracked[message.request_id]
        self.counters.blocks_sent += message.num_blocks
        if tracked.aborted or message.num_blocks == 0:
            self._release(tracked)
            if tracked.aborted:
                self._finish(tracked)
            else:
                self._send_to_decode(tracked)
            return
        request, decision = tracked.request, tracked.decision
        self.decode.send(km.ImportKV(request.request_id, tracked.ticket.transfer_id, list(tracked.ticket.slots),
                                     decision.first_block, message.num_blocks, list(request.prompt_token_ids),
                                     request.adapter_id, request.cache_salt, self.config.import_grace_s))
        self.decode.send(request)
        tracked.stage = Stage.IMPORTING

    # -------------------------------------------------------- decode engine
    def _on_decode(self, message) -> list[SeqUpdate]:
        if isinstance(message, km.CachedBlocks):
            self._route(self._tracked[message.query_id], message.num_blocks)
        elif isinstance(message, km.KVImported):
            self._on_imported(message)
        elif isinstance(message, codec.StepOutputs):
            return self._on_updates(message.updates)
        elif isinstance(message, codec.RequestError):
            tracked = self._tracked.get(message.request_id)
            if tracked is not None and tracked.stage is not Stage.DONE:
                tracked.error = message.error
                self._finish_when_imported(tracked)
        return []

    def _route(self, tracked: _Tracked, num_cached_blocks: int) -> None:
        if tracked.aborted:
            self._finish(tracked)
            return
        decision = choose_route(tracked.request, num_cached_blocks, self.block_size, self.config.threshold_tokens)
        self.counters.blocks_skipped += num_cached_blocks if decision.route is Route.DISAGGREGATED else 0
        tracked.decision = decision
        if decision.route is Route.UNIFIED or decision.num_blocks > self.config.staging_blocks:
            self.counters.num_unified += 1
            self._send_to_decode(tracked)
            return
        self.counters.num_disaggregated += 1
        tracked.stage = Stage.STAGING
        self._waiting_room.append(tracked.request.request_id)
        self._start_transfers()

    def _start_transfers(self) -> None:
        """Start waiting transfers in arrival order while the transfer has room."""
        while self._waiting_room:
            tracked = self._tracked[self._waiting_room[0]]
            ticket = self.transfer.reserve(f"t{next(self._transfer_ids)}", tracked.decision.num_blocks)
            if ticket is None:
                return
            self._waiting_room.popleft()
            tracked.ticket, tracked.stage = ticket, Stage.PREFILLING
            request = tracked.request
            self.prefill.send(km.ExportOnFinish(request.request_id, ticket.transfer_id, list(ticket.slots),
                                                tracked.decision.first_block))
            self.prefill.send(_prefill_request(request))

    def _on_imported(self, message: km.KVImported) -> None:
        tracked = self._tracked[message.request_id]
        self.counters.blocks_received += message.num_imported
        self.counters.blocks_present_on_import += message.num_present
        self.counters.blocks_dropped += message.num_dropped
        self._release(tracked)
        if tracked.stage is Stage.IMPORTING:
            tracked.stage = Stage.DECODING
        if tracked.aborted or tracked.error is not None:
            self._finish(tracked)

    def _on_updates(self, updates: list[SeqUpdate]) -> list[SeqUpdate]:
        live = []
        for update in updates:
            tracked = self._tracked.get(update.request_id)
            if tracked is None or tracked.aborted or tracked.stage is Stage.DONE:
                continue
            tracked.outputs.setdefault(update.sibling_index, []).extend(update.new_token_ids)
            if update.finish_reason is not None:
                tracked.finish_reasons[update.sibling_index] = update.finish_reason
                if len(tracked.finish_reasons) == tracked.request.params.n:
                    self._finish_when_imported(tracked)
            live.append(update)
        return live

    # -------------------------------------------------------------- helpers
    def _send_to_decode(self, tracked: _Tracked) -> None:
        self.decode.send(tracked.request)
        tracked.stage = Stage.DECODING

    def _finish_when_imported(self, tracked: _Tracked) -> None:
        """Done now, or once its KVImported frees the transfer room (an import in flight)."""
        if tracked.ticket is None:
            self._finish(tracked)

    def _finish(self, tracked: _Tracked) -> None:
        tracked.stage = Stage.DONE

    def _release(self, tracked: _Tracked) -> None:
        if tracked.ticket is not None:
            self.transfer.release(tracked.ticket)
            tracked.ticket = None
            self._start_transfers()

    # ------------------------------------------------------------- checking
    def check_integrity(self, timeout_s: float = 60.0) -> dict[str, km.IntegrityReport]:
        """Both engines' integrity reports (taken between their steps) and the staging
        area's own check; raises AssertionError if any fails."""
        self.transfer.check_integrity()
        reports = {}
        for engine in (self.prefill, self.decode):
            engine.send(km.CheckIntegrity())
            reports[engine.name] = self._await_report(engine, timeout_s)
        for name, report in reports.items():
            if not report.ok:
                raise AssertionError(f"{name} engine: {report.error}")
        return reports

    def _await_report(self, engine: EngineProcess, timeout_s: float) -> km.IntegrityReport:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            messages = engine.receive(0.1)
            for i, message in enumerate(messages):
                if isinstance(message, km.IntegrityReport):
                    engine.put_back(messages[i + 1:])
                    return message
                (self._on_prefill if engine is self.prefill else self._on_decode)(message)
        raise TimeoutError(f"{engine.name} engine sent no integrity report")

    def close(self) -> None:
        """Stop both engine processes and remove the staging area."""
        for engine in (self.prefill, self.decode):
            if engine is not None:
                engine.close()
        if self.transfer is not None:
            self.transfer.close()

    def __enter__(self) -> "DisaggregatedEngines":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _prefill_request(request: EngineRequest) -> EngineRequest:
    """The prefill engine's copy: same prompt and namespace, one greedy token, one sequence,
    no constraint, no grace (its blocks are read right after it ends)."""
    return dataclasses.replace(request, params=SamplingParams(max_tokens=1, temperature=0.0),
                               structured=None, prefix_cache_grace_s=0.0, num_speculative_tokens=0)

