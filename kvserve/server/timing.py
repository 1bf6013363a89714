"""Per-request latency phases and the W3C ``Server-Timing`` header that reports them.

Times are ``time.monotonic()`` seconds. ``scheduled_at`` is the start of the first engine
step that scheduled the request, read in the engine process (CLOCK_MONOTONIC is
system-wide on Linux, so the two processes' readings compare); the others are read in
the HTTP process::

    arrival ──queue──▶ scheduled_at ──prefill──▶ first token ──▶ … ──▶ finish
    └──────────────── ttft ────────────────────┘
    └──────────────────────────── total ──────────────────────────────┘

Pure functions: no clock is read here.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

PHASES = ("queue", "prefill", "ttft", "total")
HEADER = "Server-Timing"


@dataclass(frozen=True)
class RequestTiming:
    """When an HTTP request arrived, was first scheduled, got its first token and finished
    (None: not (yet) known)."""

    arrival: float
    scheduled_at: float | None = None
    first_token: float | None = None
    finish: float | None = None

    def phases_ms(self) -> dict[str, float]:
        """The known phases in milliseconds, in ``PHASES`` order. Each is clamped so that
        arrival <= scheduled <= first token <= finish (so queue + prefill == ttft <= total)."""
        phases: dict[str, float] = {}
        first = None if self.first_token is None else max(self.first_token, self.arrival)
        scheduled = None if self.scheduled_at is None else max(self.scheduled_at, self.arrival)
        if scheduled is not None and first is not None:
            scheduled = min(scheduled, first)
        if scheduled is not None:
            phases["queue"] = _ms(scheduled - self.arrival)
        if scheduled is not None and first is not None:
            phases["prefill"] = _ms(first - scheduled)
        if first is not None:
            phases["ttft"] = _ms(first - self.arrival)
        if self.finish is not None:
            phases["total"] = _ms(max(self.finish, first if first is not None else self.arrival) - self.arrival)
        return phases


def _ms(seconds: float) -> float:
    return max(0.0, seconds * 1000.0)


def combine_timings(arrival: float, parts: Iterable[tuple[float | None, float | None, float | None]],
                    now: float | None = None) -> RequestTiming:
    """One HTTP request's timing from its engine requests' ``(scheduled_at, first_token,
    finish)``: the earliest scheduling, the earliest first token, the latest finish. The
    finish is None while a part has none, unless ``now`` is given (the response ends now)."""
    parts = list(parts)
    scheduled = [p[0] for p in parts if p[0] is not None]
    first = [p[1] for p in parts if p[1] is not None]
    finished = [p[2] for p in parts if p[2] is not None]
    finish = max(finished) if parts and len(finished) == len(parts) else now
    return RequestTiming(arrival, min(scheduled, default=None), min(first, default=None), finish)


def format_server_timing(phases: dict[str, float], names: Iterable[str] = PHASES) -> str:
    """``queue;dur=12.3, prefill;dur=45.6, ...``: the ``names`` among ``phases`` (ms, one decimal)."""
    return ", ".join(f"{name};dur={phases[name]:.1f}" for name in names if name in phases)


def server_timing_comment(phases: dict[str, float]) -> bytes:
    """The SSE comment that ends a stream with its total (``: server-timing total;dur=...``);
    SSE clients ignore comment lines. Empty when the total is not known."""
    value = format_server_timing(phases, ("total",))
    return f": server-timing {value}\n\n".encode("ascii") if value else b""
