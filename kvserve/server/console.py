"""The web console: the static page at ``/`` and its status feed.

Routes (added by ``add_console_routes``):

- ``GET /`` and ``GET /console/{file}``: the static playground + engine view shipped in
  ``kvserve/server/console_static`` (public: they hold no data; the page asks for a key).
- ``GET /v1/console/status``: one JSON snapshot (``build_status``).
- ``GET /v1/console/events``: the same snapshot as Server-Sent Events, once per interval.

The status routes show every tenant's load, so they are guarded like ``/metrics``: an admin
key when admin keys are configured, else any API key (see kvserve/server/auth.py).
Every engine number comes from the same ``EngineStats`` object that ``/metrics`` mirrors.
"""
from __future__ import annotations

import asyncio
import json
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.responses import FileResponse, StreamingResponse

from kvserve.engine.service_class import ServiceClass
from kvserve.engine.stats import EngineStats
from kvserve.server.errors import NotFoundError

STATIC_DIR = Path(__file__).with_name("console_static")
STATIC_FILES = {"index.html": "text/html; charset=utf-8", "app.js": "text/javascript; charset=utf-8",
                "style.css": "text/css; charset=utf-8"}
EVENT_INTERVAL_S = 1.0
HISTORY_POINTS = 300                 # five minutes of one-second samples


@dataclass
class HistoryPoint:
    """Counter readings at one moment (monotonic seconds); latencies as (sum, count)."""

    t: float
    generated: float
    steps: int
    ttft: tuple[float, int] = (0.0, 0)
    itl: tuple[float, int] = (0.0, 0)


def _interval_mean(a: tuple[float, int], b: tuple[float, int]) -> float | None:
    """Mean of the observations a histogram took between readings ``a`` and ``b`` (None: none)."""
    count = b[1] - a[1]
    return round((b[0] - a[0]) / count, 6) if count > 0 else None


@dataclass
class ConsoleHistory:
    """Recent counter readings; rates and latencies over the last minutes come from their
    differences."""

    points: deque = field(default_factory=lambda: deque(maxlen=HISTORY_POINTS))

    def record(self, point: HistoryPoint) -> None:
        """Keep a reading (at most one per half second)."""
        if self.points and point.t - self.points[-1].t < 0.5:
            return
        self.points.append(point)

    def series(self) -> list[dict]:
        """Per interval between readings (oldest first): tokens/s, steps/s, and the mean TTFT
        and TPOT (inter-token latency) of what was observed in it (None: nothing was)."""
        out = []
        pairs = zip(list(self.points)[:-1], list(self.points)[1:])
        for a, b in pairs:
            dt = b.t - a.t
            out.append({"age_s": round(self.points[-1].t - b.t, 2),
                        "tokens_per_s": round((b.generated - a.generated) / dt, 3),
                        "steps_per_s": round((b.steps - a.steps) / dt, 3),
                        "ttft_mean_s": _interval_mean(a.ttft, b.ttft),
                        "tpot_mean_s": _interval_mean(a.itl, b.itl)})
        return out


def _kv_view(stats: EngineStats, info) -> dict:
    """The KV pool: blocks by state, and the start-up arithmetic the engine logged."""
    free = max(stats.kv_blocks_total - stats.kv_blocks_used - stats.kv_blocks_cached, 0)
    view = {"blocks_total": stats.kv_blocks_total, "blocks_used": stats.kv_blocks_used,
            "blocks_cached": stats.kv_blocks_cached, "blocks_free": free, "dtype": stats.kv_cache_dtype}
    if info is not None:
        view.update(block_size=info.block_size, max_tokens=info.kv_max_tokens, max_model_len=info.max_model_len,
                    num_blocks_at_start=info.num_blocks, explanation=info.kv_explanation)
    return view


def _classes(requests) -> dict:
    """HTTP-side engine requests per service class: waiting (not yet scheduled) and running."""
    out = {c.value: {"running": 0, "waiting": 0} for c in ServiceClass}
    for tracked in requests:
        if tracked.finish_time is not None:
            continue
        row = out.setdefault(tracked.service_class.value, {"running": 0, "waiting": 0})
        row["running" if tracked.started else "waiting"] += 1
    return out


def _totals(histogram) -> tuple[float, int]:
    """Sum and count of a latency histogram (all label sets together)."""
    return (sum(s.sum for s in histogram.series.values()), sum(s.count for s in histogram.series.values()))


def _latency(histogram) -> dict:
    """Count and mean of a latency histogram since start."""
    total, count = _totals(histogram)
    return {"count": count, "mean_s": round(total / count, 6) if count else None}


def _subtrees(stats: EngineStats) -> list[dict]:
    """The prefix cache's largest branches (sizes and namespace; no tokens)."""
    return [{"adapter": t.adapter_id, "namespace": t.cache_salt, "blocks": t.num_blocks, "leaves": t.num_leaves,
             "locked_blocks": t.num_locked_blocks} for t in stats.prefix_cache_subtrees]


def build_status(stats: EngineStats, info, requests, metrics, history: ConsoleHistory | None = None,
                 model_name: str = "", max_num_seqs: int | None = None) -> dict:
    """The console's snapshot.

    ``stats``: the engine's latest EngineStats (what /metrics mirrors); ``info``: the
    EngineReady message (None before start); ``requests``: the HTTP process's tracked engine
    requests; ``metrics``: the ServerMetrics (latency histograms, token counters);
    ``max_num_seqs``: the engine's decode slots (its configured batch size; None: unknown)."""
    spec = stats.speculation
    generated = sum(metrics.generation_tokens.values.values())
    return {
        "model": model_name,
        "time": time.time(),
        "engine": {"running": stats.num_running_seqs, "waiting": stats.num_waiting_seqs,
                   "steps": stats.num_steps, "preemptions": stats.num_preemptions,
                   "integrity_ok": stats.integrity_ok, "step_time_fixed_s": stats.step_time_fixed_s,
                   "step_time_per_token_s": stats.step_time_per_token_s},
        "decode_slots": {"used": stats.num_running_seqs, "total": max_num_seqs},
        "classes": _classes(requests),
        "kv": _kv_view(stats, info),
        "prefix_cache": {"enabled": stats.prefix_cache_enabled, "hit_rate": stats.prefix_cache_hit_rate,
                         "hit_tokens": stats.prefix_cache_hit_tokens, "queries": stats.prefix_cache_queries,
                         "blocks": stats.prefix_cache_blocks, "evicted_blocks": stats.prefix_cache_evicted_blocks,
                         "largest_subtrees": _subtrees(stats)},
        "speculation": {"enabled": spec.enabled, "proposed": spec.num_proposed, "accepted": spec.num_accepted,
                        "mean_accepted_length": spec.mean_accepted_length},
        "tokens": {"generated_total": generated},
        "latency": {"ttft": _latency(metrics.ttft), "itl": _latency(metrics.itl)},
        "history": history.series() if history is not None else [],
    }


def _snapshot(ctx, history: ConsoleHistory) -> dict:
    client = ctx.client
    stats = client.stats if client is not None else EngineStats()
    info = client.info if client is not None else None
    requests = list(client.requests.values()) if client is not None else []
    metrics = ctx.metrics
    history.record(HistoryPoint(time.monotonic(), sum(metrics.generation_tokens.values.values()), stats.num_steps,
                                _totals(metrics.ttft), _totals(metrics.itl)))
    slots = (getattr(client, "engine_config", None) or {}).get("max_num_seqs")
    return build_status(stats, info, requests, ctx.metrics, history, ctx.model_name, slots)


def _static(name: str) -> FileResponse:
    return FileResponse(STATIC_DIR / name, media_type=STATIC_FILES[name], headers={"Cache-Control": "no-cache"})


def add_console_routes(app: FastAPI, ctx) -> None:
    """Register the console's page, assets and status feed on ``app`` (``ctx``: ServingContext)."""
    history = ConsoleHistory()

    @app.get("/", include_in_schema=False)
    async def console_page():
        return _static("index.html")

    @app.get("/console/{name}", include_in_schema=False)
    async def console_asset(name: str):
        if name not in STATIC_FILES:
            raise NotFoundError(f"no console file {name!r}")
        return _static(name)

    @app.get("/v1/console/status")
    async def console_status():
        """One snapshot of the engine for the console (same source as /metrics)."""
        return _snapshot(ctx, history)

    @app.get("/v1/console/events", include_in_schema=False)     # an endless stream: kept from fuzzers
    async def console_events(request: Request):
        """The status snapshot as Server-Sent Events, one per second until the client leaves
        (or, with no live engine, one snapshot: the page reconnects)."""
        async def events():
            while True:
                yield f"data: {json.dumps(_snapshot(ctx, history))}\n\n".encode()
                if ctx.client is None or getattr(ctx.client, "dead", False) or await request.is_disconnected():
                    return
                await asyncio.sleep(EVENT_INTERVAL_S)
        return StreamingResponse(events(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
