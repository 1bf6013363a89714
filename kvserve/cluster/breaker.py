"""A replica's circuit breaker: stop sending to a replica that keeps failing, probe it, let
it back in once a probe succeeds.

CLOSED (routable) -> after ``failure_threshold`` consecutive failures -> OPEN (never chosen)
-> after ``open_s`` -> HALF_OPEN (up to ``max_probes`` requests at a time go through) -> a
probe's success closes it, a failure opens it again for another ``open_s``.
"""
from __future__ import annotations

import enum


class BreakerState(str, enum.Enum):
    CLOSED = "closed"
    OPEN = "open"
    HALF_OPEN = "half_open"


class CircuitBreaker:
    """One replica's breaker; ``now`` is passed in (seconds), so it is deterministic."""

    def __init__(self, failure_threshold: int = 3, open_s: float = 5.0, max_probes: int = 1):
        self.failure_threshold, self.open_s, self.max_probes = failure_threshold, open_s, max_probes
        self.state = BreakerState.CLOSED
        self.consecutive_failures = 0
        self.opened_at = 0.0
        self.probes_in_flight = 0

    def routable(self, now: float) -> bool:
        """Whether a router may consider the replica now (OPEN turns HALF_OPEN after ``open_s``)."""
        if self.state is BreakerState.OPEN and now - self.opened_at >= self.open_s:
            self.state, self.probes_in_flight = BreakerState.HALF_OPEN, 0
        if self.state is BreakerState.HALF_OPEN:
            return self.probes_in_flight < self.max_probes
        return self.state is BreakerState.CLOSED

    def on_send(self) -> None:
        """A request was sent to the replica (counts as a probe while half open)."""
        if self.state is BreakerState.HALF_OPEN:
            self.probes_in_flight += 1

    def on_success(self) -> None:
        self.state, self.consecutive_failures, self.probes_in_flight = BreakerState.CLOSED, 0, 0

    def on_failure(self, now: float) -> None:
        """The replica failed a request (died, refused the connection, errored before a byte)."""
        self.consecutive_failures += 1
        if self.state is BreakerState.HALF_OPEN or self.consecutive_failures >= self.failure_threshold:
            self.state, self.opened_at, self.probes_in_flight = BreakerState.OPEN, now, 0
