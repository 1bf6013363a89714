"""``DisaggregatedEngines`` as a service for an asyncio front end: one thread drives it.

    front end (its event loop)                    driver thread (the only one that touches the driver)
      submit / abort / finish / to_decode /   ──▶  command deque + wake socket
      to_both / status                             select(prefill socket, decode socket, wake socket)
                                                     commands -> DisaggregatedEngines (sends)
                                                     engine messages -> DisaggregatedEngines.on_message
      deliver(DriverEvents)                   ◀──    the decode engine's StepOutputs (live updates only),
      (called on the driver thread: the              RequestError, CacheBlocks, EngineStatsUpdate, control
       front end hops to its loop)                   answers; the driver's counters when they changed

Why a thread: the driver is synchronous (blocking ``sendall`` on two sockets, ``select``)
and not thread-safe. In its own thread a send that waits for a busy engine to read never
stalls the HTTP event loop, and the driver's state machine needs no change or lock: every
call into it happens here. The thread sleeps in ``select`` (no polling) and wakes for an
engine message or a command. Requests the driver has ended are taken (``take_result``)
here, so it forgets them.

Control messages (reset the prefix cache, load / unload an adapter) go to both engines;
the decode engine's answer is delivered (the front end's FIFO of waiters matches it), the
prefill engine's is dropped (logged when it refused). ``status()`` checks both engines'
block accounting between their steps (CheckIntegrity) and the staging area.
"""
from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
import select
import socket
import threading
from collections import Counter, deque
from dataclasses import dataclass, field
from typing import Callable

from kvserve.disagg.driver import DisaggConfig, DisaggCounters, DisaggregatedEngines, Stage
from kvserve.ipc import codec, kv_messages as km

logger = logging.getLogger("kvserve.disagg")
IDLE_WAIT_S = 1.0


@dataclass
class DriverEvents:
    """What one turn of the driver thread has for the front end: ``messages`` of the decode
    engine in order; ``counters`` (a copy) and ``stages`` (live requests per stage) when
    they changed; ``gone``: why the pair stopped serving (an engine died, a bug)."""

    messages: list = field(default_factory=list)
    counters: DisaggCounters | None = None
    stages: dict[str, int] | None = None
    gone: str | None = None


@dataclass
class _StatusQuery:
    future: concurrent.futures.Future
    reports: dict[str, km.IntegrityReport] = field(default_factory=dict)


class DisaggService(threading.Thread):
    """Starts the engine pair and drives it in this thread. ``deliver(DriverEvents)`` is
    called on this thread; ``ready`` resolves to the decode engine's EngineReady (or the
    start-up error); ``exit_codes`` holds both engines' exit codes once the thread ended."""

    def __init__(self, engine_config: dict, config: DisaggConfig, prefill_config: dict, decode_config: dict,
                 deliver: Callable[[DriverEvents], None]):
        super().__init__(name="kvserve-disagg-driver", daemon=True)
        self._args = (dict(engine_config), config, dict(prefill_config), dict(decode_config))
        self._deliver = deliver
        self.ready: concurrent.futures.Future = concurrent.futures.Future()
        self.engines: DisaggregatedEngines | None = None
        self.exit_codes: dict[str, int | None] = {}
        self.pids: dict[str, int] = {}
        self._commands: deque[tuple[str, object]] = deque()
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)            # a full wake buffer already means "wake up"
        self._closing = False
        self._live: set[str] = set()                 # request ids the driver holds (not taken yet)
        self._status: deque[_StatusQuery] = deque()
        self._last_counters: DisaggCounters | None = None
        self._last_stages: dict[str, int] | None = None

    # ------------------------------------------------ front end (any thread)
    def submit(self, request) -> None:
        """Route ``request`` (an EngineRequest) through the driver."""
        self._command("add", request)

    def abort(self, request_ids: list[str]) -> None:
        """End these requests at whatever stage they are (counted as aborted)."""
        self._command("abort", list(request_ids))

    def finish(self, request_ids: list[str]) -> None:
        """The front end ended these requests itself (stop strings): the driver forgets them."""
        self._command("finish", list(request_ids))

    def to_decode(self, message) -> None:
        """Send a codec message to the decode engine (StopSequences: seq ids are its own)."""
        self._command("decode", message)

    def to_both(self, message) -> None:
        """Send a control message to both engines; only the decode engine's answer is delivered."""
        self._command("both", message)

    def status(self) -> concurrent.futures.Future:
        """A future of both engines' integrity reports, the staging area, counters and stages."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._command("status", future)
        return future

    def close(self) -> None:
        """Stop serving: both engine processes are told to exit (killed after 10 s)."""
        self._command("close", None)

    def _command(self, kind: str, payload) -> None:
        self._commands.append((kind, payload))
        try:
            self._wake_w.send(b"\0")
        except BlockingIOError:            # wake-ups are pending already
            pass
        except OSError:                    # the thread has ended; the command is dropped
            pass

    # ------------------------------------------------------------ the thread
    def run(self) -> None:
        engine_config, config, prefill_config, decode_config = self._args
        try:
            self.engines = DisaggregatedEngines(engine_config, config, prefill_config, decode_config)
        except BaseException as exc:       # noqa: BLE001 - handed to the front end as it is
            _settle(self.ready, exception=exc)
            self._wake_r.close()
            self._wake_w.close()
            return
        self.pids = {e.name: e.process.pid for e in (self.engines.prefill, self.engines.decode)}
        if not _settle(self.ready, result=self.engines.decode.info):   # the front end gave up waiting
            self._closing = True
        gone = None
        try:
            self._serve()
        except EOFError as exc:
            gone = str(exc)
        except Exception as exc:           # a driver or protocol bug: stop serving, say why
            logger.exception("the disaggregation driver failed")
            gone = f"the disaggregation driver failed: {exc!r}"
        finally:
            self._wind_down(gone)

    def _serve(self) -> None:
        engines = self.engines
        while not self._closing:
            ready, _, _ = select.select([engines.prefill, engines.decode, self._wake_r], [], [], IDLE_WAIT_S)
            out = DriverEvents()
            self._drain_wake()
            self._run_commands()
            for engine in (engines.prefill, engines.decode):
                if engine in ready:
                    for message in engine.receive(0.0):
                        self._on_message(engine, message, out.messages)
            self._take_done()
            self._note_changes(out)
            if out.messages or out.counters is not None:
                self._deliver(out)

    def _wind_down(self, gone: str | None) -> None:
        """Close both engines, fail pending status queries, tell the front end if unplanned."""
        if self.engines is not None:
            self.engines.close()
            self.exit_codes = {e.name: e.process.returncode for e in (self.engines.prefill, self.engines.decode)}
        for query in self._status:
            _settle(query.future, exception=RuntimeError("the engines stopped"))
        self._status.clear()
        self._wake_r.close()
        self._wake_w.close()
        if not self._closing:
            self._deliver(DriverEvents(gone=gone or "the disaggregation driver stopped"))

    def _drain_wake(self) -> None:
        try:
            while self._wake_r.recv(4096):
                pass
        except BlockingIOError:
            pass

    def _run_commands(self) -> None:
        engines = self.engines
        while self._commands:
            kind, payload = self._commands.popleft()
            if kind == "add":
                engines.add_request(payload)
                self._live.add(payload.request_id)
            elif kind in ("abort", "finish"):
                for request_id in payload:
                    (engines.abort if kind == "abort" else engines.finish)(request_id)
            elif kind == "decode":
                engines.decode.send(payload)
            elif kind == "both":
                engines.decode.send(payload)
                engines.prefill.send(payload)
            elif kind == "status":
                self._status.append(_StatusQuery(payload))
                for engine in (engines.prefill, engines.decode):
                    engine.send(km.CheckIntegrity())
            elif kind == "close":
                self._closing = True

    # ------------------------------------------------------- engine messages
    def _on_message(self, engine, message, out: list) -> None:
        if isinstance(message, km.IntegrityReport):
            self._on_report(engine.name, message)
        elif engine is self.engines.prefill:
            if isinstance(message, codec.AdapterResult) and message.error is not None:
                logger.warning("prefill engine refused an adapter command: %s", message.error)
            self.engines.on_message(engine, message)      # KVExported; the rest is not the client's
        elif isinstance(message, codec.StepOutputs):
            live = self.engines.on_message(engine, message)
            out.append(dataclasses.replace(message, updates=live))
        else:
            self.engines.on_message(engine, message)      # CachedBlocks, KVImported, RequestError
            if not isinstance(message, (km.CachedBlocks, km.KVImported)):
                out.append(message)

    def _on_report(self, name: str, report: km.IntegrityReport) -> None:
        """Engines answer CheckIntegrity in order: the oldest query without this engine's report."""
        query = next((q for q in self._status if name not in q.reports), None)
        if query is None:                  # nobody asked: nothing to answer
            return
        query.reports[name] = report
        if len(query.reports) == 2:
            self._status.remove(query)
            _settle(query.future, result=self._status_view(query.reports))

    def _status_view(self, reports: dict[str, km.IntegrityReport]) -> dict:
        engines = self.engines
        transfer, transfer_error = engines.transfer, None
        try:
            transfer.check_integrity()
        except AssertionError as exc:
            transfer_error = str(exc) or "staging area integrity check failed"
        ok = transfer_error is None and all(r.ok for r in reports.values())
        return {"ok": ok, "engines": {name: dataclasses.asdict(r) for name, r in reports.items()},
                "transfer": {"num_blocks": engines.config.staging_blocks, "num_free_blocks": transfer.num_free_blocks,
                             "reserved": list(transfer.reserved), "error": transfer_error},
                "requests": self._stages(), "counters": dataclasses.asdict(engines.counters), "pids": dict(self.pids),
                "threshold_tokens": engines.config.threshold_tokens, "block_size": engines.block_size}

    # ------------------------------------------------------------- helpers
    def _take_done(self) -> None:
        """Forget the requests the driver has ended (their outputs went out as updates)."""
        done = [rid for rid in self._live if self.engines.stage(rid) is Stage.DONE]
        for request_id in done:
            self.engines.take_result(request_id)
            self._live.discard(request_id)

    def _stages(self) -> dict[str, int]:
        stages = Counter(self.engines.stage(rid).value for rid in self._live)
        return {stage.value: stages.get(stage.value, 0) for stage in Stage if stage is not Stage.DONE}

    def _note_changes(self, out: DriverEvents) -> None:
        counters, stages = self.engines.counters, self._stages()
        if counters != self._last_counters or stages != self._last_stages:
            self._last_counters, self._last_stages = dataclasses.replace(counters), stages
            out.counters, out.stages = self._last_counters, stages


def _settle(future: concurrent.futures.Future, result=None, exception: BaseException | None = None) -> bool:
    """Resolve ``future`` unless its waiter cancelled it (timed out); whether it was resolved."""
    try:
        if exception is not None:
            future.set_exception(exception)
        else:
            future.set_result(result)
    except concurrent.futures.InvalidStateError:
        return False
    return True
