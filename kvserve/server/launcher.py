"""Run the server: uvicorn in this (HTTP) process, the engine in a child process.

Lifecycle::

    start: HTTP listens at once (/ready 503 "starting") ──▶ engine loaded ──▶ ready
    SIGTERM/SIGINT: /ready 503 and new requests 503 at once; in-flight requests get
        --drain-timeout to finish, then end with finish_reason "abort"; uvicorn stops,
        the engine is told to exit; exit code 0.  A second SIGINT forces the exit.
    engine process dies: every in-flight request gets an error at once (EOF on the
        engine socket), /ready 503, and the server exits with code 1 (for a supervisor).
    engine refuses its configuration at start (a bad --lora-modules adapter): the
        message goes to stderr and the server exits with code 2, as for a bad flag.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import sys
import time

import uvicorn

from kvserve.server.app import ServingContext, build_app
from kvserve.server.engine_client import EngineClient
from kvserve.server.errors import EngineStartError
from kvserve.server.http_protocol import HttpLimits, http_protocol_factory

logger = logging.getLogger("kvserve.server")
EXIT_GRACE_S = 0.5            # let error responses flush before stopping after an engine death


class _Uvicorn(uvicorn.Server):
    """uvicorn whose signals start a drain instead of an immediate shutdown, and which
    does not re-raise the signal afterwards (so a drained server exits 0)."""

    def __init__(self, config: uvicorn.Config, on_stop_signal):
        super().__init__(config)
        self._on_stop_signal = on_stop_signal
        self._signalled = False
        self._loop: asyncio.AbstractEventLoop | None = None

    @contextlib.contextmanager
    def capture_signals(self):
        self._loop = asyncio.get_running_loop()
        previous = {sig: signal.signal(sig, self._handle) for sig in (signal.SIGTERM, signal.SIGINT)}
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    def _handle(self, sig, frame) -> None:
        if self._signalled:
            if sig == signal.SIGINT:
                self.should_exit = self.force_exit = True
            return
        self._signalled = True
        self._loop.call_soon_threadsafe(self._on_stop_signal)


class KVServer:
    """Owns the uvicorn server, the engine client and the drain / death handling."""

    def __init__(self, ctx: ServingContext, engine_config: dict, host: str, port: int,
                 drain_timeout_s: float = 30.0, engine_start_timeout_s: float = 600.0,
                 http_limits: HttpLimits | None = None, client_factory=EngineClient):
        """``client_factory(tokenizer, metrics, engine_config, on_dead=...)`` builds the engine
        client: ``EngineClient`` (one engine process) or, with ``--disaggregate``,
        ``disagg_client.DisaggEngineClient`` (a prefill and a decode engine) bound to its settings."""
        self.ctx = ctx
        self.client_factory = client_factory
        self.engine_config = engine_config
        self.drain_timeout_s = drain_timeout_s
        self.engine_start_timeout_s = engine_start_timeout_s
        self.http_limits = http_limits or HttpLimits()
        protocol = http_protocol_factory(self.http_limits, on_refused=self._count_refusal)
        config = uvicorn.Config(build_app(ctx), host=host, port=port, log_level="warning", access_log=False,
                                lifespan="off", timeout_graceful_shutdown=5, backlog=4096, http=protocol)
        self.uvicorn = _Uvicorn(config, self._start_drain)
        ctx.start_drain = self._start_drain
        self.exit_code = 0
        self._tasks: set[asyncio.Task] = set()

    def _count_refusal(self, status: int, code: str) -> None:
        """A refusal of the HTTP protocol itself (431, 408, 400, connection cap) in /metrics."""
        self.ctx.metrics.rejected.inc(status=str(status), code=code)

    async def serve(self) -> int:
        self._spawn(self.start_engine())
        await self.uvicorn.serve()
        if self.ctx.client is not None:
            code = await self.ctx.client.shutdown()
            logger.info("engine process exited with code %s", code)
        return self.exit_code

    def _spawn(self, coro) -> None:
        task = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def start_engine(self) -> None:
        """Start the engine process and mark the server ready (a start-up failure ends the server)."""
        client = self.client_factory(self.ctx.tokenizer, self.ctx.metrics, self.engine_config,
                                     on_dead=self._on_engine_dead)
        self.ctx.client = client
        try:
            info = await client.start(self.engine_start_timeout_s)
        except EngineStartError as err:   # the engine refused its configuration: a usage error
            print(f"kvserve serve: {err.message}", file=sys.stderr, flush=True)
            self._fail_start(f"the engine refused its configuration: {err.message}", 2)
            return
        except Exception as exc:          # model missing, engine crashed while loading, timeout
            logger.error("the engine failed to start: %r", exc)
            self._fail_start(f"the engine failed to start: {exc!r}", 1)
            return
        logger.info("engine ready (pid %d): %s", info.pid, info.kv_explanation)
        self.ctx.state.engine_ready = True

    def _fail_start(self, reason: str, exit_code: int) -> None:
        self.ctx.state.startup_error = reason
        self.ctx.state.engine_dead = True
        self.exit_code = exit_code
        self.uvicorn.should_exit = True

    def _on_engine_dead(self) -> None:
        self.ctx.state.engine_dead = True
        self.exit_code = 1
        asyncio.get_running_loop().call_later(EXIT_GRACE_S, self._stop_uvicorn)

    def _stop_uvicorn(self) -> None:
        self.uvicorn.should_exit = True

    def _start_drain(self) -> None:
        """SIGTERM / SIGINT or POST /admin/drain: once."""
        if self.ctx.state.draining:
            return
        logger.warning("stop signal: draining (up to %.1f s)", self.drain_timeout_s)
        self.ctx.state.draining = True
        self._spawn(self._drain())

    async def _drain(self) -> None:
        active = self.ctx.active
        deadline = time.monotonic() + self.drain_timeout_s
        while active and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        if active:
            logger.warning("drain timeout: aborting %d requests", len(active))
            for generation in list(active):
                generation.control("drain")
            flush_deadline = time.monotonic() + 5.0
            while active and time.monotonic() < flush_deadline:
                await asyncio.sleep(0.05)
        self._stop_uvicorn()


def pin_cpus(spec: str | None) -> list[int] | None:
    """``"0"`` / ``"0,1"`` / ``"0-3"`` -> CPU ids (None when not given)."""
    if not spec:
        return None
    cpus: list[int] = []
    for part in spec.split(","):
        lo, _, hi = part.partition("-")
        cpus.extend(range(int(lo), int(hi or lo) + 1))
    return cpus


def set_http_affinity(cpus: list[int] | None) -> None:
    if cpus:
        os.sched_setaffinity(0, set(cpus))
