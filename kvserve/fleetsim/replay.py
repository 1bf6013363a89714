"""Play a trace into a running kvserve cluster over HTTP and watch its replica count.

``replay_trace`` sends each request of a ``RequestLog`` at its arrival time (open loop: a request
never waits for an earlier one) to ``/v1/completions`` as a streamed completion of its prompt ids
(``prompt_ids.prompt_token_ids``: its group's shared prefix if it has one, then tokens of its
own; ``seed`` salts them, so a probe and a trace share nothing) with ``max_tokens`` = ``output``
and ``ignore_eos``, and fills a copy of the log with each request's first-token and finish
times (seconds from the trace's start, the first chunk that carries text or token ids) and the
prompt tokens the engine's prefix cache served (the stream's ``usage``). A request the server
refuses or breaks is marked rejected.

With ``turn_gap_s`` a trace of conversations is played closed loop, as ``validate`` plays it into
an engine: a later turn is sent no sooner than the gap after its previous turn's answer ended
(``conversations.turn_due``; its arrival becomes that time), and its prompt carries what the
cluster answered (``prompt_ids.continued_prompt``: the previous turn's ids, the answer's ids the
server returned with ``return_token_ids``, then its own).

``watch_replicas`` polls the ingress's ``GET /cluster/status`` (Ray Serve's own view, answered by
the ingress without touching a replica) and records the engine deployment's replicas by state
when they change: the measured replica count over time.
"""
from __future__ import annotations

import asyncio
import time
from typing import Callable

import httpx
import numpy as np

from kvserve.fleetsim.conversations import turn_due
from kvserve.fleetsim.log import RequestLog
from kvserve.fleetsim.prompt_ids import continued_prompt, prompt_token_ids
from kvserve.loadgen.sse import sse_events

POLL_EVERY_S = 1.0
REPLICA_HEADER = "x-kvserve-replica"


def request_body(prompt_ids: list[int], max_tokens: int, model: str | None) -> dict:
    """A streamed greedy completion of ``prompt_ids`` producing exactly ``max_tokens`` tokens,
    its ids returned (a closed loop's next turn carries them)."""
    body = {"prompt": prompt_ids, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}, "return_token_ids": True}
    if model:
        body["model"] = model
    return body


class _Replay:
    """One replay of a trace (``replay_trace``): the log it fills, the clock, and per request
    the replica that answered, the ids it was sent and the ids it got back."""

    def __init__(self, client: httpx.AsyncClient, url: str, trace: RequestLog, vocab_size: int,
                 model: str | None, seed: int, t0: float, turn_gap_s: float | None):
        self.client, self.url, self.model, self.seed, self.t0 = client, url, model, seed, t0
        self.vocab_size, self.turn_gap_s = vocab_size, turn_gap_s
        self.log = trace.fresh()
        self.served_by: list[str | None] = [None] * len(trace)
        self.sent: dict[int, list[int]] = {}
        self.outputs: dict[int, list[int]] = {r: [] for r in range(len(trace))}
        self.ended = [asyncio.Event() for _ in range(len(trace))]

    def now(self) -> float:
        return time.perf_counter() - self.t0

    async def turn(self, request: int) -> None:
        """Send ``request`` when it is due (``conversations.turn_due``: its arrival, or in a
        closed loop its previous turn's end plus the gap; the arrival becomes that time), with
        its prompt (``continued_prompt`` in a closed loop), and read its answer."""
        log, parent = self.log, self.log.parent[request]
        await asyncio.sleep(max(0.0, log.arrival[request] - self.now()))
        if self.turn_gap_s is not None and parent >= 0:
            await self.ended[parent].wait()
            due = turn_due(log, request, self.turn_gap_s)
            await asyncio.sleep(max(0.0, due - self.now()))
            log.arrival[request] = due
            ids = continued_prompt(log, request, self.sent[parent] + self.outputs[parent], self.vocab_size,
                                   self.seed)
        else:
            ids = prompt_token_ids(log, request, self.vocab_size, salt=self.seed)
        self.sent[request] = ids
        try:
            await self._read(request, request_body(ids, log.output[request], self.model))
        finally:
            self.ended[request].set()

    async def _read(self, request: int, body: dict) -> None:
        log = self.log
        try:
            async with self.client.stream("POST", self.url, json=body) as response:
                self.served_by[request] = response.headers.get(REPLICA_HEADER)
                if response.status_code != 200:
                    await response.aread()
                    log.reject(request, self.now())
                    return
                async for event in sse_events(response):
                    if "error" in event:
                        log.reject(request, self.now())
                        return
                    choices = event.get("choices") or []
                    new_ids = [t for c in choices for t in c.get("token_ids") or ()]
                    self.outputs[request] += new_ids
                    if (new_ids or any(c.get("text") for c in choices)) and np.isnan(log.first_token_s[request]):
                        log.first_token(request, self.now())
                    details = (event.get("usage") or {}).get("prompt_tokens_details") or {}
                    log.cached_tokens[request] = details.get("cached_tokens", log.cached_tokens[request])
            log.finish(request, self.now())
        except httpx.HTTPError:
            log.reject(request, self.now())


async def replay_trace(base_url: str, trace: RequestLog, vocab_size: int, model: str | None = None,
                       seed: int = 0, t0: float | None = None, turn_gap_s: float | None = None,
                       headers: dict[str, str] | None = None) -> tuple[RequestLog, list[str | None]]:
    """Send every request of ``trace`` at its arrival time (seconds after ``t0``, a
    ``time.perf_counter`` value; now by default), or with ``turn_gap_s`` its conversations
    closed loop (the module docstring), with ``headers`` (an API key): the filled copy of the
    log, and the replica that answered each request (the ingress's ``x-kvserve-replica`` header)."""
    t0 = time.perf_counter() if t0 is None else t0
    limits = httpx.Limits(max_connections=len(trace) or 1, max_keepalive_connections=len(trace) or 1)
    async with httpx.AsyncClient(limits=limits, timeout=httpx.Timeout(600.0, connect=30.0), headers=headers) as client:
        replay = _Replay(client, base_url.rstrip("/") + "/v1/completions", trace, vocab_size, model, seed, t0,
                         turn_gap_s)
        await asyncio.gather(*(replay.turn(request) for request in range(len(trace))))
    return replay.log, replay.served_by


async def watch_replicas(base_url: str, stop: asyncio.Event, t0: float, deployment: str = "engine",
                         every_s: float = POLL_EVERY_S, on_change: Callable[[], None] | None = None
                         ) -> list[tuple[float, dict[str, int]]]:
    """Until ``stop`` is set: (seconds after ``t0``, the deployment's replicas by Ray Serve state)
    each time they change, the first poll included; ``on_change()`` is called at each."""
    changes: list[tuple[float, dict[str, int]]] = []
    async with httpx.AsyncClient(timeout=30.0) as client:
        while not stop.is_set():
            r = await client.get(base_url.rstrip("/") + "/cluster/status")
            if r.status_code == 200:
                states = r.json()["deployments"][deployment]["replicas"]
                if not changes or changes[-1][1] != states:
                    changes.append((time.perf_counter() - t0, states))
                    if on_change is not None:
                        on_change()
            try:
                await asyncio.wait_for(stop.wait(), every_s)
            except asyncio.TimeoutError:
                pass
    return changes


async def replay_and_watch(base_url: str, trace: RequestLog, vocab_size: int, model: str | None = None,
                           seed: int = 0, on_change: Callable[[], None] | None = None, t0: float | None = None
                           ) -> tuple[RequestLog, list[str | None], list[tuple[float, dict[str, int]]]]:
    """``replay_trace`` with ``watch_replicas`` (and its ``on_change``) beside it, on one clock
    (from ``t0``, a ``time.perf_counter`` value; now by default): the log, the replica of each
    request, the replica count's changes."""
    stop, t0 = asyncio.Event(), time.perf_counter() if t0 is None else t0
    watcher = asyncio.create_task(watch_replicas(base_url, stop, t0, on_change=on_change))
    try:
        log, served_by = await replay_trace(base_url, trace, vocab_size, model, seed, t0)
    finally:
        stop.set()
    return log, served_by, await watcher


def running_steps(changes: list[tuple[float, dict[str, int]]]) -> list[tuple[float, int]]:
    """The RUNNING count's step function from ``watch_replicas``'s changes."""
    steps: list[tuple[float, int]] = []
    for t, states in changes:
        running = int(states.get("RUNNING", 0))
        if not steps or steps[-1][1] != running:
            steps.append((t, running))
    return steps


def starting(states: dict[str, int]) -> int:
    """How many replicas one poll saw starting (STARTING or PENDING_*)."""
    return sum(v for k, v in states.items() if k.startswith("PENDING") or k == "STARTING")


def start_windows(changes: list[tuple[float, dict[str, int]]]) -> list[tuple[int, int]]:
    """Each scale-up's start as indices into ``changes``: (the change where a replica appeared as
    STARTING or PENDING_*, the change where the RUNNING count grew), as the poll saw them. A start
    given up before it ran (the replica gone with no RUNNING one more: a scale-down decided while
    it started) ends its window unpaired: the next start is timed from its own beginning."""
    windows, asked_at, last_running = [], None, None
    for i, (_, states) in enumerate(changes):
        running = int(states.get("RUNNING", 0))
        pending = starting(states)
        grew = last_running is not None and running > last_running
        if pending and asked_at is None:
            asked_at = i
        if grew and asked_at is not None:
            windows.append((asked_at, i))
            asked_at = i if pending else None
        elif not pending:
            asked_at = None                    # given up (or none asked): no start under way
        last_running = running
    return windows


def whole_start_windows(changes: list[tuple[float, dict[str, int]]]) -> list[tuple[int, int]]:
    """``start_windows`` less a start already under way at the first change (one asked for
    before the watch began, as the probe's replica is at the trace's start: the poll did not see
    it begin, so its span is only the part after the first poll); all of them where that leaves
    none (lower bounds, the best there is)."""
    windows = start_windows(changes)
    return [(begin, end) for begin, end in windows if begin > 0] or windows


def start_durations(changes: list[tuple[float, dict[str, int]]]) -> list[float]:
    """Seconds from a replica appearing as STARTING (or PENDING_*) to the RUNNING count growing:
    each scale-up's measured start the poll saw whole (``whole_start_windows``), as it saw it
    (within ``POLL_EVERY_S``)."""
    return [changes[end][0] - changes[begin][0] for begin, end in whole_start_windows(changes)]


def start_spans(changes: list[tuple[float, dict[str, int]]]) -> list[tuple[float, float]]:
    """The spans some replica was starting (STARTING or PENDING_*) on the changes' clock, a start
    given up included (its processes ran until it went): from the poll that first saw one to
    the first that saw none (the last poll where one was still starting at the end)."""
    spans, begun = [], None
    for t, states in changes:
        pending = starting(states)
        if pending and begun is None:
            begun = t
        elif not pending and begun is not None:
            spans.append((begun, t))
            begun = None
    return spans + ([(begun, changes[-1][0])] if begun is not None else [])
