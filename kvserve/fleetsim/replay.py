"""Play a trace into a running kvserve cluster over HTTP and watch its replica count.

``replay_trace`` sends each request of a ``RequestLog`` at its arrival time (open loop: a request
never waits for an earlier one) to ``/v1/completions`` as a streamed completion of its prompt ids
(``prompt_ids.prompt_token_ids``: its group's shared prefix if it has one, then tokens of its
own; ``seed`` salts them, so a probe and a trace share nothing) with ``max_tokens`` = ``output``
and ``ignore_eos``, and fills a copy of the log with each request's first-token and finish
times (seconds from the trace's start, the first chunk that carries text) and the prompt tokens
the engine's prefix cache served (the stream's ``usage``). A request the server refuses or
breaks is marked rejected.

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

from kvserve.fleetsim.log import RequestLog
from kvserve.fleetsim.prompt_ids import prompt_token_ids
from kvserve.loadgen.sse import sse_events

POLL_EVERY_S = 1.0
REPLICA_HEADER = "x-kvserve-replica"


def request_body(prompt_ids: list[int], max_tokens: int, model: str | None) -> dict:
    """A streamed greedy completion of ``prompt_ids`` producing exactly ``max_tokens`` tokens."""
    body = {"prompt": prompt_ids, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}
    if model:
        body["model"] = model
    return body


async def _one(client: httpx.AsyncClient, url: str, body: dict, request: int, log: RequestLog, t0: float,
               served_by: list) -> None:
    try:
        async with client.stream("POST", url, json=body) as response:
            served_by[request] = response.headers.get(REPLICA_HEADER)
            if response.status_code != 200:
                await response.aread()
                log.reject(request, time.perf_counter() - t0)
                return
            async for event in sse_events(response):
                if "error" in event:
                    log.reject(request, time.perf_counter() - t0)
                    return
                texts = [c.get("text") for c in event.get("choices") or []]
                if any(texts) and np.isnan(log.first_token_s[request]):
                    log.first_token(request, time.perf_counter() - t0)
                details = (event.get("usage") or {}).get("prompt_tokens_details") or {}
                log.cached_tokens[request] = details.get("cached_tokens", log.cached_tokens[request])
        log.finish(request, time.perf_counter() - t0)
    except httpx.HTTPError:
        log.reject(request, time.perf_counter() - t0)


async def replay_trace(base_url: str, trace: RequestLog, vocab_size: int, model: str | None = None,
                       seed: int = 0, t0: float | None = None) -> tuple[RequestLog, list[str | None]]:
    """Send every request of ``trace`` at its arrival time (seconds after ``t0``, a
    ``time.perf_counter`` value; now by default): the filled copy of the log, and the replica
    that answered each request (the ingress's ``x-kvserve-replica`` header)."""
    log, served_by = trace.fresh(), [None] * len(trace)
    url = base_url.rstrip("/") + "/v1/completions"
    t0 = time.perf_counter() if t0 is None else t0
    limits = httpx.Limits(max_connections=len(log) or 1, max_keepalive_connections=len(log) or 1)
    async with httpx.AsyncClient(limits=limits, timeout=httpx.Timeout(600.0, connect=30.0)) as client:
        tasks = []
        for request in range(len(log)):
            ids = prompt_token_ids(log, request, vocab_size, salt=seed)
            await asyncio.sleep(max(0.0, log.arrival[request] - (time.perf_counter() - t0)))
            tasks.append(asyncio.create_task(_one(client, url, request_body(ids, log.output[request], model),
                                                  request, log, t0, served_by)))
        await asyncio.gather(*tasks)
    return log, served_by


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
                           seed: int = 0, on_change: Callable[[], None] | None = None
                           ) -> tuple[RequestLog, list[str | None], list[tuple[float, dict[str, int]]]]:
    """``replay_trace`` with ``watch_replicas`` (and its ``on_change``) beside it, on one clock: the
    log, the replica of each request, the replica count's changes."""
    stop, t0 = asyncio.Event(), time.perf_counter()
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


def start_windows(changes: list[tuple[float, dict[str, int]]]) -> list[tuple[int, int]]:
    """Each scale-up's start as indices into ``changes``: (the change where a replica appeared as
    STARTING or PENDING_*, the change where the RUNNING count grew), as the poll saw them."""
    windows, asked_at, last_running = [], None, None
    for i, (_, states) in enumerate(changes):
        running = int(states.get("RUNNING", 0))
        pending = sum(v for k, v in states.items() if k.startswith("PENDING") or k == "STARTING")
        if pending and asked_at is None:
            asked_at = i
        if last_running is not None and running > last_running and asked_at is not None:
            windows.append((asked_at, i))
            asked_at = i if pending else None
        last_running = running
    return windows


def start_durations(changes: list[tuple[float, dict[str, int]]]) -> list[float]:
    """Seconds from a replica appearing as STARTING (or PENDING_*) to the RUNNING count growing:
    each scale-up's measured start, as the poll saw it (within ``POLL_EVERY_S``)."""
    return [changes[end][0] - changes[begin][0] for begin, end in start_windows(changes)]
