"""The degradation ladder at the cluster's ingress: what it measures and what each rung does
to a request before it is forwarded (``ladder.py`` decides the rung).

Signals: over the last ``window_s`` seconds of answered requests, the p90 time to the first
byte of chat-class generation requests the fleet served (their TTFT as the client sees it,
queue wait included; the ladder compares it with the chat TTFT SLO) and the fraction refused
with 503; and the KV use of the fleet's fullest replica, as the router last saw it (each
routing decision carries it: ``ray_router.py``; a reading older than the window counts as 0).
Effects on a generation request: ``speculation_off`` sets ``num_speculative_tokens: 0``;
``cap_batch_tokens`` lowers a batch request's ``max_tokens``; ``shed_batch`` and
``priority_only`` refuse with 503 ``server_degraded`` + Retry-After; ``overflow_chat`` sends
chat requests beyond the fleet's decode slots to the fallback deployment (``overflow.py``).
Every answer carries ``x-kvserve-degradation``."""
from __future__ import annotations

import json
import logging
import time
from collections import deque
from dataclasses import dataclass

from kvserve.cluster.ladder import Degradation, Ladder, LadderSettings, LoadSignal, Rung, pressure_components
from kvserve.engine.service_class import ServiceClass, parse_class

HEADER = "x-kvserve-degradation"
logger = logging.getLogger("kvserve.cluster")


@dataclass
class Outcome:
    """One answered request."""

    at: float
    service_class: ServiceClass | None
    status: int
    first_byte_s: float


def request_class(values: dict, pinned: ServiceClass | None) -> ServiceClass:
    """The class a generation body runs in: the key's pin, else its service_tier, else chat."""
    if pinned is not None:
        return pinned
    tier = values.get("service_tier")
    try:
        return parse_class(tier) if isinstance(tier, str) else ServiceClass.CHAT
    except ValueError:
        return ServiceClass.CHAT


class DegradationController:
    """Keeps the recent outcomes and the fleet's latest KV reading, moves the ladder, and
    applies its rung to requests. ``engagements``: times each rung engaged (for metrics)."""

    def __init__(self, settings: LadderSettings | None = None, window_s: float = 30.0, clock=time.monotonic):
        self.ladder = Ladder(settings)
        self.window_s = window_s
        self.clock = clock
        self.outcomes: deque[Outcome] = deque()
        self.kv_reading: tuple[float, float] | None = None      # (when, fullest replica's KV use)
        self.engagements: dict[Rung, int] = {rung: 0 for rung in self.ladder.rungs[1:]}
        self.last_signal = LoadSignal()

    def observe_kv(self, kv_usage: float) -> None:
        """The fleet's fullest replica's fraction of KV blocks in use (a routing decision's view)."""
        self.kv_reading = (self.clock(), float(kv_usage))

    def record(self, service_class: ServiceClass | None, status: int, first_byte_s: float) -> Degradation:
        """One request the fleet answered; returns the rung in force after it."""
        now = self.clock()
        self.outcomes.append(Outcome(now, service_class, status, first_byte_s))
        while self.outcomes and now - self.outcomes[0].at > self.window_s:
            self.outcomes.popleft()
        before = self.ladder.rung
        self.last_signal = self.signal()
        effects = self.ladder.observe(self.last_signal, now)
        if effects.rung is not before:
            if effects.rung > before:
                self.engagements[effects.rung] += 1
            logger.warning("degradation rung %s -> %s (pressure %.2f: %s)", before.name.lower(), effects.header,
                           self.ladder.last_pressure, self.last_signal)
        return effects

    def signal(self) -> LoadSignal:
        """The window's chat first-byte p90 and 503 fraction, and the latest fresh KV reading."""
        chat = sorted(o.first_byte_s for o in self.outcomes if o.service_class is ServiceClass.CHAT and o.status == 200)
        p90 = chat[min(len(chat) - 1, int(0.9 * len(chat)))] if chat else 0.0
        refused = sum(o.status == 503 for o in self.outcomes)
        fresh = self.kv_reading is not None and self.clock() - self.kv_reading[0] <= self.window_s
        return LoadSignal(chat_queue_wait_s=p90, kv_usage=self.kv_reading[1] if fresh else 0.0,
                          rejection_rate=refused / len(self.outcomes) if self.outcomes else 0.0)

    def pressure_components(self) -> dict[str, float]:
        """The ratios behind the last move of the ladder, by signal name."""
        return pressure_components(self.last_signal, self.ladder.settings)

    def current(self) -> Degradation:
        return self.ladder.current()

    def apply(self, body: bytes, service_class: ServiceClass, tenant: str | None) -> tuple[bytes, str | None]:
        """The body to forward under the current rung, or a refusal reason (then no body)."""
        effects = self.ladder.current()
        if service_class in effects.shed_classes:
            return b"", f"batch requests are shed at degradation rung {effects.header}"
        if effects.admit_only_tenants is not None and tenant not in effects.admit_only_tenants:
            return b"", f"only priority tenants are admitted at degradation rung {effects.header}"
        if effects.speculation and effects.batch_max_tokens is None:
            return body, None
        values = json.loads(body)
        if not effects.speculation:
            values["num_speculative_tokens"] = 0
        if effects.batch_max_tokens is not None and service_class is ServiceClass.BATCH:
            asked = values.pop("max_completion_tokens", None) or values.get("max_tokens")
            values["max_tokens"] = min(asked, effects.batch_max_tokens) if isinstance(asked, int) \
                else effects.batch_max_tokens
        return json.dumps(values).encode(), None
