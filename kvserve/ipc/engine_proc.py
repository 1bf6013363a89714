"""The engine-core process: owns the model, the scheduler and the KV cache.

Started by the HTTP process as ``python -m kvserve.ipc.engine_proc --fd N`` with
one end of a socket pair; everything on it goes through :mod:`kvserve.ipc.codec`.
It never sees HTTP, JSON or text.

Loop (one iteration per engine step)::

    read every message already waiting (block only while there is no work)
      -> add / abort / stop sequences / reset prefix cache / load or unload an adapter / shutdown
    step the engine if it has work -> send StepOutputs (updates + stats)
    idle: check block-pool integrity, send EngineStats

An abort therefore takes effect before the next step: its blocks are free within
one engine step. EOF on the socket (the HTTP process is gone) ends the process.
"""
from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import select
import signal
import socket
import sys
import time

from kvserve.engine.kv.cache_events import BlockStored
from kvserve.engine.request import RequestStatus
from kvserve.engine.stats import EngineStats
from kvserve.ipc import codec
from kvserve.ipc.weight_commands import WeightsGate

logger = logging.getLogger("kvserve.engine_proc")
IDLE_POLL_S = 0.5


class EngineLoop:
    """Applies messages to an EngineCore and steps it while it has work."""

    def __init__(self, engine, sock: socket.socket):
        self.engine = engine
        self.sock = sock
        self.frames = codec.FrameBuffer()
        self.running = True
        self.waiting_ids: set[str] = set()        # added, not yet scheduled (queue time running)
        self.tenants: dict[str, str | None] = {}  # request id -> tenant
        self.num_aborted = 0
        self.integrity_ok = True
        self._dirty = False                       # sequences ended outside a step: prune tenants
        self.weights = WeightsGate()              # a pending load / sleep / wake and what waits behind it

    # ----------------------------------------------------------------- I/O
    def send(self, message) -> None:
        self.sock.sendall(codec.encode(message))

    def receive(self, timeout: float) -> list:
        """Messages already waiting on the socket, waiting up to ``timeout`` seconds for the first."""
        messages = []
        while True:
            ready, _, _ = select.select([self.sock], [], [], timeout)
            if not ready:
                return messages
            data = self.sock.recv(1 << 20)
            if not data:
                raise EOFError("the HTTP process closed the engine socket")
            messages.extend(self.frames.feed(data))
            timeout = 0.0

    # ------------------------------------------------------------- messages
    def handle(self, message) -> None:
        if isinstance(message, codec.EngineRequest):
            if not self.weights.hold(message):
                self._add(message)
        elif isinstance(message, codec.AbortRequests):
            for request_id in message.request_ids:
                self._forget(request_id)
                if self.weights.release(request_id) or self.engine.abort_request(request_id):
                    self.num_aborted += 1
        elif isinstance(message, codec.WeightsCommand):
            refused = self.weights.offer(message)
            if refused is not None:
                self.send(refused)
            self.run_weights_command()
        elif isinstance(message, codec.StopSequences):
            for seq_id in message.seq_ids:
                self.engine.stop_sequence(seq_id)
            self._dirty = True
        elif isinstance(message, codec.ResetPrefixCache):
            self.send(codec.PrefixCacheReset(int(self.engine.reset_prefix_cache())))
            self.send_cache_blocks()
        elif isinstance(message, (codec.LoadAdapter, codec.UnloadAdapter)):
            self.send(self._adapter_command(message))
        elif isinstance(message, codec.Shutdown):
            self.running = False
        else:
            logger.warning("ignoring unexpected message %s", type(message).__name__)

    def run_weights_command(self) -> None:
        """Run a pending weights command once nothing is in flight; then admit what it held."""
        result, held = self.weights.run_if_idle(self.engine)
        if result is None:
            return
        self.send(result)
        self.send_cache_blocks()                  # an epoch bump or sleep drops cached blocks
        for request in held:
            self._add(request)

    def _add(self, request: codec.EngineRequest) -> None:
        """Queue the request exactly as the HTTP process built it (its cache salt was
        derived from the caller's tenant: tenants never share KV blocks)."""
        from kvserve.errors import KVServeError
        try:
            self.engine.add_request(request)
        except KVServeError as err:
            self.send(codec.RequestError(request.request_id, err.http_status, err.to_dict()))
            return
        self.waiting_ids.add(request.request_id)
        self.tenants[request.request_id] = request.tenant

    def _adapter_command(self, message) -> codec.AdapterResult:
        """Load or unload an adapter between steps; a refusal is answered with the typed
        error's body (the engine keeps serving). Sequences already running with an
        unloaded adapter finish with it."""
        from kvserve.errors import KVServeError
        try:
            if isinstance(message, codec.LoadAdapter):
                adapter = self.engine.load_adapter(message.name, message.path)
            else:
                self.engine.unload_adapter(message.name)
                adapter = None
        except KVServeError as err:
            return codec.AdapterResult(err.http_status, self.engine.list_adapters(), error=err.to_dict())
        except Exception:                  # a bug or an unreadable file the checks missed
            logger.exception("%s failed", type(message).__name__)
            err = KVServeError(f"{type(message).__name__} {message.name!r} failed; see the server log")
            return codec.AdapterResult(err.http_status, self.engine.list_adapters(), error=err.to_dict())
        return codec.AdapterResult(200, self.engine.list_adapters(), adapter=adapter)

    def _forget(self, request_id: str) -> None:
        self.waiting_ids.discard(request_id)
        self.tenants.pop(request_id, None)

    # ----------------------------------------------------------------- step
    def step(self) -> None:
        step_start = time.monotonic()             # the step's schedule() comes next: queue time ends here
        updates = self.engine.step()
        started = self._newly_started()
        if self._dirty or any(u.finish_reason is not None for u in updates):
            self._prune()
        self.send(codec.StepOutputs(updates, started, self.stats(), step_start))
        self.send_cache_blocks()

    def send_cache_blocks(self) -> None:
        """The prefix cache's block hashes stored and removed since the last call, if any."""
        stored, removed = [], []
        for event in self.engine.drain_cache_events():
            (stored if isinstance(event, BlockStored) else removed).extend(event.block_hashes)
        if stored or removed:
            self.send(codec.CacheBlocks(stored, removed))

    def _prune(self) -> None:
        """Forget requests the scheduler no longer holds (finished, stopped or aborted)."""
        for request_id in [r for r in self.tenants if not self._request_live(r)]:
            self._forget(request_id)
        self._dirty = False

    def _newly_started(self) -> list[str]:
        """Requests scheduled for the first time in the last step (queue time over)."""
        if not self.waiting_ids:
            return []
        started = [rid for rid in self.waiting_ids if self.engine.request_status(rid) is not RequestStatus.WAITING]
        self.waiting_ids.difference_update(started)
        return started

    def _request_live(self, request_id: str) -> bool:
        return self.engine.request_status(request_id) is not None

    def stats(self) -> EngineStats:
        return dataclasses.replace(self.engine.stats(), num_requests=len(self.tenants),
                                   num_aborted=self.num_aborted, integrity_ok=self.integrity_ok)

    def check_idle_integrity(self) -> None:
        try:
            self.engine.check_integrity()
        except AssertionError as exc:      # an invariant broke: report it, keep serving
            logger.error("block pool integrity check failed: %s", exc)
            self.integrity_ok = False

    # ----------------------------------------------------------------- loop
    def run(self) -> None:
        while self.running:
            busy = self.engine.has_unfinished()
            held_s = self.engine.idle_wait_s() if busy else None   # a batching window is open
            messages = self.receive(IDLE_POLL_S if not busy else min(held_s or 0.0, IDLE_POLL_S))
            for message in messages:
                self.handle(message)
            if not self.running:
                break
            if self.engine.has_unfinished():
                self.step()
                self.run_weights_command()
            elif busy or messages:            # just went idle, or aborts/stops landed
                self.tenants.clear()              # nothing unfinished: every request has ended
                self.waiting_ids.clear()
                self.check_idle_integrity()
                self.send(codec.EngineStatsUpdate(self.stats()))


def _read_init(sock: socket.socket) -> codec.InitEngine:
    frames = codec.FrameBuffer()
    while True:
        data = sock.recv(1 << 16)
        if not data:
            raise EOFError("no InitEngine message")
        messages = frames.feed(data)
        if messages:
            if not isinstance(messages[0], codec.InitEngine):
                raise codec.CodecError("the first message must be InitEngine")
            return messages[0]


def build_engine(engine_config: dict):
    """An EngineCore from EngineConfig fields."""
    from kvserve.builder import build_engine as build
    from kvserve.engine.config import EngineConfig
    from kvserve.loader import resolve_model_path
    return build(EngineConfig(**{**engine_config, "model": resolve_model_path(engine_config.get("model"))}))


def kv_layout(engine) -> dict:
    """The shape of one KV block in every layer (layers, block_size, kv heads, head dim,
    dtype), what a KV transfer between engines must agree on; {} when the runner has no
    single KV tensor (tensor parallel) or it is not a plain float tensor."""
    import torch
    kv_cache = getattr(engine.runner, "kv_cache", None)
    if not isinstance(kv_cache, torch.Tensor) or engine.config.tensor_parallel_size > 1:
        return {}
    layers, _two, _blocks, block_size, kv_heads, head_dim = kv_cache.shape
    return {"num_layers": layers, "block_size": block_size, "num_kv_heads": kv_heads, "head_dim": head_dim,
            "dtype": str(kv_cache.dtype).replace("torch.", "")}


def serve(sock: socket.socket, make_loop=EngineLoop, extra_keys: tuple[str, ...] = ()) -> int:
    """Load the engine named by the first message, report it (EngineReady, or EngineFailed
    and exit code 2 for a configuration the engine refuses), then run the loop.
    ``make_loop(engine, sock, **extras)`` builds the loop (an ``EngineLoop`` subclass, e.g.
    kvserve/disagg/worker.py's); ``extra_keys`` are InitEngine entries that are not
    EngineConfig fields, taken out and passed to it as ``extras``."""
    from kvserve.engine.startup_gc import freeze_startup_objects
    from kvserve.errors import KVServeError
    init = _read_init(sock)
    extras = {key: init.engine_config.pop(key) for key in extra_keys if key in init.engine_config}
    cpus = init.engine_config.pop("cpus", None)
    if cpus:
        os.sched_setaffinity(0, set(cpus))
    try:
        engine = build_engine(init.engine_config)
    except KVServeError as err:          # a bad start-up adapter, an impossible setting
        logger.error("the engine cannot start: %s", err.message)
        sock.sendall(codec.encode(codec.EngineFailed(err.http_status, err.to_dict())))
        return 2
    loop = make_loop(engine, sock, **extras)
    freeze_startup_objects()
    loop.send(codec.EngineReady(
        max_model_len=engine.max_model_len, vocab_size=engine.model_config.vocab_size,
        num_blocks=engine.kv.num_blocks, block_size=engine.config.block_size,
        kv_max_tokens=engine.kv_plan.max_tokens, eos_token_ids=sorted(engine.model_config.eos_token_ids),
        kv_explanation=engine.kv_plan.explanation, pid=os.getpid(), adapters=engine.list_adapters(),
        kv_layout=kv_layout(engine), start_timings=dict(engine.start_timings)))
    try:
        loop.run()
    except (EOFError, BrokenPipeError, ConnectionResetError):
        logger.info("HTTP process gone; engine exiting")
    finally:
        engine.close()
    return 0


def ignore_stop_signals() -> None:
    """SIGINT / SIGTERM sent to the whole process group (Ctrl-C in a terminal, ``kill -TERM
    -PGID``, systemd's control-group kill) also reach this process: it ignores them, so the
    HTTP process alone decides, drains its streams and then tells the engine to exit. The
    engine still ends when told, or when the socket to the HTTP process closes."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)


def run_engine_process(argv: list[str] | None, description: str, log_name: str, default_level: str = "INFO",
                       make_loop=None) -> int:
    """An engine process's entry point: its socket from ``--fd``, stop signals ignored, the
    log configured, then ``serve`` (with ``make_loop``'s loop class when given)."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--fd", type=int, required=True, help="inherited socket file descriptor")
    args = parser.parse_args(argv)
    ignore_stop_signals()
    logging.basicConfig(level=os.environ.get("KVSERVE_LOG_LEVEL", default_level),
                        format=f"%(levelname)s {log_name}: %(message)s", stream=sys.stderr)
    sock = socket.socket(fileno=args.fd)
    sock.setblocking(True)
    try:
        return serve(sock) if make_loop is None else serve(sock, make_loop=make_loop)
    finally:
        sock.close()


def main(argv: list[str] | None = None) -> int:
    return run_engine_process(argv, "kvserve engine-core process (started by kvserve serve)", "engine")


if __name__ == "__main__":
    sys.exit(main())
