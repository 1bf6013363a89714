"""The HTTP process's handle on the engine process.

Spawns ``python -m kvserve.ipc.engine_proc`` with one end of a socket pair,
sends it codec messages, and turns what comes back into per-request events:

    engine ──StepOutputs──▶ OutputProcessor.process_deltas ──▶ sink queue of the HTTP request
                                  │ stop string matched
                                  └──StopSequences──▶ engine

Events put on a request's sink, as ``(tag, event)``: a ``CompletionDelta``, the
final ``RequestOutput`` (the request finished), or a ``KVServeError`` (the engine
refused or lost it). Exactly one of the last two ends every request.

Control queries (reset the prefix cache, load / unload an adapter) are answered by the
engine in the order they were sent, between steps; one FIFO of waiters matches each
answer to its query (``_query``). The loaded adapters' names, which requests may select
as ``model``, come with EngineReady and with every adapter answer.
"""
from __future__ import annotations

import asyncio
import logging
import os
import socket
import subprocess
import sys
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable

from kvserve.engine.request import EngineRequest
from kvserve.engine.service_class import ServiceClass
from kvserve.engine.stats import EngineStats
from kvserve.errors import KVServeError
from kvserve.frontend.output_processor import OutputProcessor
from kvserve.frontend.outputs import RequestOutput
from kvserve.ipc import codec
from kvserve.server.errors import EngineStartError, ServiceUnavailableError
from kvserve.server.metrics import ServerMetrics

logger = logging.getLogger("kvserve.server")


@dataclass
class TrackedRequest:
    """One engine request as the HTTP process sees it (timings feed the metrics and the
    Server-Timing header; all ``time.monotonic()`` seconds)."""

    request_id: str
    sink: asyncio.Queue
    tag: int
    num_prompt_tokens: int
    arrival: float
    num_uncached_tokens: int = 0          # prompt tokens not in the prefix cache when it was sent (estimate)
    started: bool = False
    first_token_time: float | None = None
    last_token_time: dict[int, float] = field(default_factory=dict)   # per completion index
    num_generated: int = 0
    adapter: str | None = None            # the LoRA adapter's name (None: the base model)
    service_class: ServiceClass = ServiceClass.CHAT
    scheduled_at: float | None = None     # start of the first engine step that scheduled it (engine's clock)
    finish_time: float | None = None      # when it finished, was aborted or failed
    tokens_per_index: dict[int, int] = field(default_factory=dict)    # tokens generated per completion index

    def time_per_output_token(self) -> float | None:
        """(last token - first token) / (tokens - 1) of the longest completion; None below two tokens."""
        if not self.tokens_per_index or self.first_token_time is None:
            return None
        index = max(self.tokens_per_index, key=self.tokens_per_index.get)
        count = self.tokens_per_index[index]
        if count < 2:
            return None
        return max(0.0, self.last_token_time[index] - self.first_token_time) / (count - 1)


class EngineClient:
    """Owns the engine process and the output processor; one per server."""

    def __init__(self, tokenizer, metrics: ServerMetrics, engine_config: dict,
                 on_dead: Callable[[], None] | None = None):
        self.tokenizer = tokenizer
        self.metrics = metrics
        self.engine_config = dict(engine_config)
        self.on_dead = on_dead
        self.processor = OutputProcessor(tokenizer, self._stop_sequence)
        self.requests: dict[str, TrackedRequest] = {}
        self.info: codec.EngineReady | None = None
        self.stats = EngineStats()
        self.cached_blocks: set[int] = set()               # hashes of the blocks the engine's prefix cache holds
        self.process: subprocess.Popen | None = None
        self.dead = False
        self.last_token_time = time.monotonic()
        self._closing = False
        self._writer: asyncio.StreamWriter | None = None
        self._reader_task: asyncio.Task | None = None
        self._pending_stops: list[int] = []
        self._waiters: deque[tuple[type, asyncio.Future]] = deque()   # control queries sent, answers pending
        self.adapters: dict[str, dict] = {}                # loaded adapters by name (engine's descriptions)

    # ------------------------------------------------------------- lifecycle
    async def start(self, timeout_s: float = 600.0) -> codec.EngineReady:
        """Spawn the engine process and wait until its model is loaded."""
        spawned = time.monotonic()
        parent, child = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        self.process = subprocess.Popen(
            [sys.executable, "-m", "kvserve.ipc.engine_proc", "--fd", str(child.fileno())],
            pass_fds=(child.fileno(),), env=env)
        child.close()
        reader, self._writer = await asyncio.open_unix_connection(sock=parent)
        self._send(codec.InitEngine(self.engine_config))
        info = await asyncio.wait_for(self._read_ready(reader), timeout_s)
        self._set_adapters(info.adapters)
        self.metrics.start.record(info.start_timings, time.monotonic() - spawned)
        self.info = info
        self._reader_task = asyncio.create_task(self._read_loop(reader))
        return self.info

    async def _read_ready(self, reader: asyncio.StreamReader) -> codec.EngineReady:
        """EngineReady; ``EngineStartError`` with the engine's message if it refused its
        configuration (EngineFailed)."""
        message = await self._read_message(reader)
        if isinstance(message, codec.EngineFailed):
            raise EngineStartError(error_from_body(message.status, message.error).message)
        if not isinstance(message, codec.EngineReady):
            raise RuntimeError(f"engine sent {type(message).__name__} before EngineReady")
        return message

    @staticmethod
    async def _read_message(reader: asyncio.StreamReader):
        header = await reader.readexactly(codec.FRAME_HEADER.size)
        (size,) = codec.FRAME_HEADER.unpack(header)
        if size > codec.MAX_FRAME_BYTES:
            raise codec.CodecError(f"frame of {size} bytes")
        return codec.decode_payload(await reader.readexactly(size))

    async def shutdown(self, timeout_s: float = 10.0) -> int | None:
        """Ask the engine to exit; kill it if it does not within ``timeout_s``. Its exit code."""
        self._closing = True
        if self.process is None:
            return None
        if self.process.poll() is None and not self.dead:
            try:
                self._send(codec.Shutdown())
                await self._writer.drain()
            except (ConnectionError, RuntimeError):
                pass
        deadline = time.monotonic() + timeout_s
        while self.process.poll() is None and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait()
        if self._writer is not None:
            self._writer.close()
        return self.process.returncode

    # -------------------------------------------------------------- requests
    def submit(self, request: EngineRequest, prompt_text: str | None, sink: asyncio.Queue, tag: int,
               arrival: float) -> TrackedRequest:
        """Send a validated request to the engine as it is; its events go to ``sink`` tagged ``tag``.
        The returned record keeps its timings after the request ends."""
        if self.dead or self.info is None:
            raise ServiceUnavailableError("the engine is not running", code="engine_unavailable")
        request_id, num_prompt = request.request_id, len(request.prompt_token_ids)
        tracked = TrackedRequest(request_id, sink, tag, num_prompt, arrival, self._uncached_tokens(request),
                                 adapter=request.adapter_id, service_class=request.service_class)
        self.requests[request_id] = tracked
        self.processor.add_request(request_id, prompt_text, request.prompt_token_ids, request.params)
        self.metrics.prompt_tokens.inc(num_prompt)
        self._send(request)
        return tracked

    def adapter_identity(self, name: str | None) -> str | None:
        """The engine's key of the adapter loaded as ``name`` (its files' digest: what its cache
        namespaces blocks by), as the last adapter listing said; the name if unlisted."""
        if name is None:
            return None
        return self.adapters.get(name, {}).get("id", name)

    def _uncached_tokens(self, request: EngineRequest) -> int:
        """Prompt tokens past the longest prefix of full blocks the engine's cache holds now (by
        its cache events; weight epoch 0, as the router hashes). A waiting request whose history is
        cached is little work: counting its whole prompt as queued made the router move
        conversations away from the replica that holds them."""
        if not self.cached_blocks or not request.use_prefix_cache or self.info is None:
            return len(request.prompt_token_ids)
        from kvserve.engine.kv.cache_events import CacheNamespace
        from kvserve.router.index import request_block_hashes
        block_size = self.info.block_size
        namespace = CacheNamespace(self.adapter_identity(request.adapter_id), 0, request.cache_salt)
        matched = 0
        for block in request_block_hashes(request.prompt_token_ids, namespace, block_size):
            if block not in self.cached_blocks:
                break
            matched += 1
        return len(request.prompt_token_ids) - matched * block_size

    async def reset_prefix_cache(self, timeout_s: float = 30.0) -> int:
        """Admin: have the engine drop every prefix-cached block no running request uses;
        how many it dropped."""
        reply = await self._query(codec.ResetPrefixCache(), codec.PrefixCacheReset, timeout_s)
        return reply.num_blocks

    async def load_adapter(self, name: str, path: str, timeout_s: float = 120.0) -> dict:
        """Admin: load the PEFT folder ``path`` as adapter ``name``; its description. The
        engine's typed error (400 bad adapter or duplicate name) is raised as it is."""
        reply = await self._query(codec.LoadAdapter(name, path), codec.AdapterResult, timeout_s)
        if reply.error is not None:
            raise error_from_body(reply.status, reply.error)
        return reply.adapter

    async def unload_adapter(self, name: str, timeout_s: float = 120.0) -> None:
        """Admin: ``name`` stops selecting an adapter (404 if none is loaded under it);
        requests already running with it finish with it."""
        reply = await self._query(codec.UnloadAdapter(name), codec.AdapterResult, timeout_s)
        if reply.error is not None:
            raise error_from_body(reply.status, reply.error)

    async def weights_command(self, action: str, path: str | None = None, timeout_s: float = 600.0) -> dict:
        """Admin: load weights in place / sleep / wake (``ipc/weight_commands.py``); what the
        engine reports. It answers once the requests in flight have finished; its typed error
        (400 another shape, 409 busy or asleep) is raised as it is."""
        reply = await self._query(codec.WeightsCommand(action, path), codec.WeightsResult, timeout_s)
        if reply.error is not None:
            raise error_from_body(reply.status, reply.error)
        return reply.result

    async def _query(self, message, reply_type: type, timeout_s: float):
        """Send a control message and wait for its answer (answers come in the order the
        queries were sent; a query that timed out keeps its place, its answer is dropped,
        but an adapter answer still updates ``adapters``). 503 if no answer in time."""
        if self.dead or self.info is None:
            raise ServiceUnavailableError("the engine is not running", code="engine_unavailable")
        waiter = asyncio.get_running_loop().create_future()
        self._waiters.append((reply_type, waiter))
        self._send(message)
        try:
            return await asyncio.wait_for(waiter, timeout_s)
        except asyncio.TimeoutError:
            raise ServiceUnavailableError(f"the engine did not answer {type(message).__name__} within "
                                          f"{timeout_s:g} s", code="engine_timeout") from None

    def _answer(self, reply) -> None:
        """Hand a control answer to the oldest waiting query (it must be of that type)."""
        if isinstance(reply, codec.AdapterResult):
            self._set_adapters(reply.adapters)
        if not self._waiters:
            raise codec.CodecError(f"unexpected {type(reply).__name__}: no query is waiting")
        reply_type, waiter = self._waiters[0]
        if not isinstance(reply, reply_type):      # a protocol bug: the read loop drops the engine
            raise codec.CodecError(f"got {type(reply).__name__}, expected {reply_type.__name__}")
        self._waiters.popleft()
        if not waiter.done():
            waiter.set_result(reply)

    def _set_adapters(self, adapters: list[dict]) -> None:
        self.adapters = {a["name"]: a for a in adapters}

    def abort(self, request_id: str) -> RequestOutput | None:
        """End a request now (client gone, deadline, drain): the engine frees its blocks before
        its next step. Returns the output so far (unfinished completions: ``abort``), or None
        if the request had already ended. Puts nothing on the sink."""
        tracked = self.requests.pop(request_id, None)
        if tracked is None:
            return None
        self._end(tracked, time.monotonic())
        if not self.dead:
            self._send(codec.AbortRequests([request_id]))
        output = self.processor.abort_request(request_id)
        self.metrics.finished.inc(finish_reason="abort")
        return output

    @property
    def num_queued(self) -> int:
        """Requests admitted but not yet scheduled by the engine."""
        return sum(1 for r in self.requests.values() if not r.started)

    @property
    def num_queued_tokens(self) -> int:
        return sum(r.num_prompt_tokens for r in self.requests.values() if not r.started)

    @property
    def num_queued_uncached_tokens(self) -> int:
        """Prompt tokens past the prefix cache of the requests not yet scheduled: the prefill
        work queued here (what the router's ``queued_tokens`` and the autoscaler's backlog read)."""
        return sum(r.num_uncached_tokens for r in self.requests.values() if not r.started)

    def refresh_queue_gauges(self) -> None:
        """Set the gauges read from the request table, not the engine's stats: in flight,
        queued, and the queued prompt tokens."""
        self.metrics.in_flight.set(len(self.requests))
        self.metrics.queued.set(self.num_queued)
        self.metrics.queued_prompt_tokens.set(self.num_queued_uncached_tokens)

    # --------------------------------------------------------------- I/O
    def _send(self, message) -> None:
        if self._writer is None or self._writer.is_closing():
            raise ServiceUnavailableError("the engine is not running", code="engine_unavailable")
        self._writer.write(codec.encode(message))

    def _stop_sequence(self, seq_id: int) -> None:
        self._pending_stops.append(seq_id)

    async def _read_loop(self, reader: asyncio.StreamReader) -> None:
        try:
            while True:
                self._handle(await self._read_message(reader))
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        except Exception:                     # a codec or processing bug: treat the engine as lost
            logger.exception("engine connection failed")
        finally:
            self._engine_gone()

    def _handle(self, message) -> None:
        if isinstance(message, codec.StepOutputs):
            self._on_step(message)
        elif isinstance(message, codec.CacheBlocks):
            self.cached_blocks.difference_update(message.removed)
            self.cached_blocks.update(message.stored)
        elif isinstance(message, codec.EngineStatsUpdate):
            self.stats = message.stats
            self.metrics.update_engine(message.stats)
        elif isinstance(message, (codec.PrefixCacheReset, codec.AdapterResult, codec.WeightsResult)):
            self._answer(message)
        elif isinstance(message, codec.RequestError):
            tracked = self.requests.pop(message.request_id, None)
            self.processor.abort_request(message.request_id)
            if tracked is not None:
                self._end(tracked, time.monotonic())
                tracked.sink.put_nowait((tracked.tag, error_from_body(message.status, message.error)))

    def _on_step(self, message: codec.StepOutputs) -> None:
        now = time.monotonic()
        step_start = message.step_start if message.step_start > 0 else now
        self.stats = message.stats
        self.metrics.update_engine(message.stats)
        for request_id in message.started:
            self._mark_started(self.requests.get(request_id), now, step_start)
        finished, deltas = self.processor.process_deltas(message.updates)
        for delta in deltas:
            tracked = self.requests.get(delta.request_id)
            if tracked is not None:
                self._record_tokens(tracked, delta.index, len(delta.token_ids), now, step_start)
                tracked.sink.put_nowait((tracked.tag, delta))
        for output in finished:
            tracked = self.requests.pop(output.request_id, None)
            if tracked is not None:
                self.metrics.e2e.observe(now - tracked.arrival)
                self._end(tracked, now, finished=True)
                for completion in output.outputs:
                    self.metrics.finished.inc(finish_reason=completion.finish_reason or "unknown")
                tracked.sink.put_nowait((tracked.tag, output))
        if self._pending_stops:
            stops, self._pending_stops = self._pending_stops, []
            self._send(codec.StopSequences(stops))

    def _mark_started(self, tracked: TrackedRequest | None, now: float, step_start: float) -> None:
        if tracked is not None and not tracked.started:
            tracked.started = True
            tracked.scheduled_at = step_start
            self.metrics.queue.observe(now - tracked.arrival)
            self.metrics.classes.observe_queue(tracked.service_class, max(0.0, step_start - tracked.arrival))

    def _end(self, tracked: TrackedRequest, now: float, finished: bool = False) -> None:
        """The request ended (``finished``, else aborted or failed): its finish time and class
        metrics (the time per output token only of a finished one)."""
        tracked.finish_time = now
        tpot = tracked.time_per_output_token() if finished else None
        self.metrics.classes.observe_end(tracked.service_class, tpot)

    def _record_tokens(self, tracked: TrackedRequest, index: int, count: int, now: float,
                       step_start: float) -> None:
        if count == 0:
            return
        self._mark_started(tracked, now, step_start)
        self.last_token_time = now
        tracked.num_generated += count
        tracked.tokens_per_index[index] = tracked.tokens_per_index.get(index, 0) + count
        self.metrics.generation_tokens.inc(count)
        if tracked.adapter is not None:
            self.metrics.lora.generation_tokens.inc(count, adapter=tracked.adapter)
        if tracked.first_token_time is None:
            tracked.first_token_time = now
            self.metrics.ttft.observe(now - tracked.arrival)
            self.metrics.classes.observe_ttft(tracked.service_class, now - tracked.arrival)
        previous = tracked.last_token_time.get(index)
        if previous is not None:
            gap = (now - previous) / count
            for _ in range(count):
                self.metrics.itl.observe(gap)
        tracked.last_token_time[index] = now

    def _engine_gone(self) -> None:
        waiters, self._waiters = self._waiters, deque()
        for _reply_type, waiter in waiters:
            if not waiter.done():
                waiter.set_exception(ServiceUnavailableError("the engine process is gone",
                                                             code="engine_unavailable"))
        if self._closing:
            return
        self.dead = True
        code = self.process.poll() if self.process is not None else None
        logger.error("the engine process exited unexpectedly (exit code %s); failing %d requests",
                     code, len(self.requests))
        requests, self.requests = self.requests, {}
        now = time.monotonic()
        for tracked in requests.values():
            self._end(tracked, now)
            self.processor.abort_request(tracked.request_id)
            tracked.sink.put_nowait((tracked.tag, ServiceUnavailableError(
                "the engine process exited unexpectedly", code="engine_unavailable")))
        if self.on_dead is not None:
            self.on_dead()


def error_from_body(status: int, body: dict) -> KVServeError:
    """The typed error an engine answer carries (``{"error": {...}}`` and its HTTP status)."""
    fields = body["error"]
    err = KVServeError(fields["message"], param=fields.get("param"), code=fields.get("code"))
    err.http_status = status
    err.error_type = fields.get("type", err.error_type)
    return err
