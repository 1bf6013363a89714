"""The HTTP process's handle on a disaggregated pair (``kvserve serve --disaggregate``).

``DisaggEngineClient`` is an ``EngineClient``: the server (serving.py, app.py, state.py,
the launcher) uses it through the very same interface — ``start``, ``submit``, ``abort``,
``shutdown``, the control queries, ``info`` / ``requests`` / ``stats`` / ``dead`` — and
the base class's code turns engine messages into per-request events, metrics and errors.
Only the transport differs::

    EngineClient._send(message)  ──▶  DisaggService (driver thread, kvserve/disagg/service.py)
        EngineRequest   -> DisaggregatedEngines.add_request (route: unified or prefill + KV move)
        AbortRequests   -> DisaggregatedEngines.abort (any stage; transfer room given back exactly)
        StopSequences   -> the decode engine (it produced the sequences)
        reset / adapters -> both engines (the decode engine's answer is the one awaited)
    DriverEvents ──call_soon_threadsafe──▶ _deliver on the event loop ──▶ EngineClient._handle
        (the decode engine's StepOutputs with live updates, errors, stats, cache blocks)

A request the front end ends itself (its stop strings matched) is ``finish``-ed in the
driver, so the driver forgets it. The driver's counters become ``kvserve_disagg_*``
series on /metrics; ``status()`` (GET /admin/disagg) checks both engines' block accounting.
This module imports torch through the driver (the staging area is a torch mapping): the
CLI imports it only with ``--disaggregate``.
"""
from __future__ import annotations

import asyncio
import logging

from kvserve.disagg import process as disagg_process
from kvserve.disagg.driver import DisaggConfig, DisaggCounters
from kvserve.disagg.service import DisaggService, DriverEvents
from kvserve.engine.request import EngineRequest
from kvserve.ipc import codec
from kvserve.server.engine_client import EngineClient, error_from_body
from kvserve.server.errors import EngineStartError, ServiceUnavailableError

logger = logging.getLogger("kvserve.server")
CONTROL_MESSAGES = (codec.ResetPrefixCache, codec.LoadAdapter, codec.UnloadAdapter)


class DisaggEngineClient(EngineClient):
    """An EngineClient whose engine is a prefill engine + a decode engine (two processes)
    driven by ``DisaggregatedEngines`` in one thread. ``info`` is the decode engine's
    EngineReady (its pid, context and KV limits are the ones requests meet)."""

    def __init__(self, tokenizer, metrics, engine_config: dict, on_dead=None, *,
                 disagg_config: DisaggConfig = DisaggConfig(), prefill_config: dict | None = None,
                 decode_config: dict | None = None):
        super().__init__(tokenizer, metrics, engine_config, on_dead=on_dead)
        self.disagg_config = disagg_config
        self.prefill_config = dict(prefill_config or {})
        self.decode_config = dict(decode_config or {})
        self.service: DisaggService | None = None
        self.counters = DisaggCounters()

    # ------------------------------------------------------------- lifecycle
    async def start(self, timeout_s: float = 600.0) -> codec.EngineReady:
        """Start both engine processes (loading in parallel) and the driver thread."""
        loop = asyncio.get_running_loop()
        self.service = DisaggService(self.engine_config, self.disagg_config, self.prefill_config,
                                     self.decode_config, lambda events: loop.call_soon_threadsafe(self._deliver, events))
        self.service.start()
        try:
            info = await asyncio.wait_for(asyncio.wrap_future(self.service.ready), timeout_s)
        except disagg_process.EngineStartError as exc:
            if exc.error is not None:      # an engine refused its configuration: a usage error
                raise EngineStartError(error_from_body(exc.status, exc.error).message) from None
            raise
        except ValueError as exc:          # the engines' KV blocks cannot move (8-bit KV, TP)
            raise EngineStartError(str(exc)) from None
        self._set_adapters(info.adapters)
        self.info = info
        self.metrics.disagg.enable(self.disagg_config.threshold_tokens)
        logger.info("disaggregated: prefill engine pid %d, decode engine pid %d, threshold %d tokens",
                    self.service.pids["prefill"], self.service.pids["decode"], self.disagg_config.threshold_tokens)
        return info

    async def shutdown(self, timeout_s: float = 10.0) -> int | None:
        """Stop the driver thread and both engines (each is killed if it has not exited
        within 10 s); the decode engine's exit code (the prefill one's if it is worse)."""
        self._closing = True
        if self.service is None:
            return None
        self.service.close()
        await asyncio.to_thread(self.service.join, 2 * timeout_s + 5)
        codes = [c for c in self.service.exit_codes.values() if c is not None]
        return max(codes, key=abs) if codes else None

    async def status(self, timeout_s: float = 30.0) -> dict:
        """Both engines' integrity reports (taken between their steps), the staging area,
        the driver's counters and its requests per stage; 503 if not answered in time."""
        if self.dead or self.service is None or self.info is None:
            raise ServiceUnavailableError("the engines are not running", code="engine_unavailable")
        try:
            status = await asyncio.wait_for(asyncio.wrap_future(self.service.status()), timeout_s)
        except asyncio.TimeoutError:
            raise ServiceUnavailableError(f"the engines did not report within {timeout_s:g} s",
                                          code="engine_timeout") from None
        except RuntimeError as exc:
            raise ServiceUnavailableError(str(exc), code="engine_unavailable") from None
        return {**status, "in_flight": len(self.requests)}

    # ------------------------------------------------------------------ I/O
    def _send(self, message) -> None:
        """The base class's messages, mapped onto the driver (see the module docstring)."""
        if self.service is None or not self.service.is_alive() or self.dead:
            raise ServiceUnavailableError("the engines are not running", code="engine_unavailable")
        if isinstance(message, EngineRequest):
            self.service.submit(message)
        elif isinstance(message, codec.AbortRequests):
            self.service.abort(message.request_ids)
        elif isinstance(message, codec.StopSequences):
            self.service.to_decode(message)
        elif isinstance(message, CONTROL_MESSAGES):
            self.service.to_both(message)
        else:
            raise TypeError(f"DisaggEngineClient cannot send {type(message).__name__}")

    def _deliver(self, events: DriverEvents) -> None:
        """On the event loop: hand the decode engine's messages to the base class's handler."""
        if events.counters is not None:
            self.counters = events.counters
            self.metrics.disagg.update(events.counters, events.stages or {})
        try:
            for message in events.messages:
                self._handle(message)
        except Exception:                  # a processing bug: treat the engines as lost
            logger.exception("disaggregated engine messages failed")
            events.gone = events.gone or "message handling failed"
            self.service.close()
        if events.gone is not None:
            logger.error("disaggregated engines stopped: %s", events.gone)
            self._engine_gone()

    def _on_step(self, message: codec.StepOutputs) -> None:
        """The base class's step handling; requests it ended itself (stop strings) are
        finished in the driver too."""
        before = set(self.requests)
        super()._on_step(message)
        ended = before.difference(self.requests)
        if ended and not self.dead:
            self.service.finish(sorted(ended))
