"""Circuit breakers: stop sending to a replica that keeps failing, probe it, let it back in
once a probe succeeds.

CLOSED (routable) -> after ``failure_threshold`` consecutive failures (or at once, ``trip``:
the replica reported itself unhealthy) -> OPEN (never chosen) -> after ``open_s`` ->
HALF_OPEN (up to ``max_probes`` probes at a time go through) -> a probe's success closes
it, a failure opens it again for another ``open_s``.

``ReplicaBreakers`` is the cluster ingress's board of them, one per replica: the ingress
reports what it sees (failures before the first byte and mid-stream, answers, the router's
health view, probe outcomes), passes ``blocked()`` with every request so the router never
chooses those replicas (``ReplicaState.breaker_open``), and sends each replica that
``due_probes()`` names one ``/ready`` probe pinned to it.
"""
from __future__ import annotations

import enum
import time
from typing import Callable, Iterable


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
        self.times_opened = 0

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
        """The replica answered (a probe's success closes a half-open breaker)."""
        self.state, self.consecutive_failures, self.probes_in_flight = BreakerState.CLOSED, 0, 0

    def on_failure(self, now: float) -> None:
        """The replica failed a request (died, refused the connection, errored before a byte)."""
        self.consecutive_failures += 1
        if self.state is BreakerState.HALF_OPEN or self.consecutive_failures >= self.failure_threshold:
            self._open(now)

    def trip(self, now: float) -> None:
        """Open now whatever the count (the replica says it is unhealthy); no-op unless CLOSED."""
        if self.state is BreakerState.CLOSED:
            self._open(now)

    def _open(self, now: float) -> None:
        if self.state is not BreakerState.OPEN:
            self.times_opened += 1
        self.state, self.opened_at, self.probes_in_flight = BreakerState.OPEN, now, 0


class ReplicaBreakers:
    """One ``CircuitBreaker`` per replica name, on one clock (seconds, monotonic).

    Normal traffic goes only to CLOSED replicas (``blocked()`` names the rest); a HALF_OPEN
    replica gets the probes ``due_probes()`` hands out, whose outcome the caller reports with
    ``on_success`` / ``on_failure``. Replicas no longer running are dropped by ``retain``."""

    def __init__(self, failure_threshold: int = 3, open_s: float = 5.0, max_probes: int = 1,
                 clock: Callable[[], float] = time.monotonic):
        self.failure_threshold, self.open_s, self.max_probes = failure_threshold, open_s, max_probes
        self.clock = clock
        self.breakers: dict[str, CircuitBreaker] = {}

    def _get(self, replica: str) -> CircuitBreaker:
        breaker = self.breakers.get(replica)
        if breaker is None:
            breaker = self.breakers[replica] = CircuitBreaker(self.failure_threshold, self.open_s, self.max_probes)
        return breaker

    def retain(self, replicas: Iterable[str]) -> None:
        """The replicas running now: new ones start CLOSED, the others' breakers are dropped."""
        current = set(replicas)
        for name in list(self.breakers):
            if name not in current:
                del self.breakers[name]
        for name in current:
            self._get(name)

    def forget(self, replica: str) -> None:
        """Drop ``replica``'s breaker (it is gone)."""
        self.breakers.pop(replica, None)

    def blocked(self) -> list[str]:
        """Replicas normal traffic must not go to now: every breaker not CLOSED."""
        now = self.clock()
        for breaker in self.breakers.values():
            breaker.routable(now)                    # OPEN -> HALF_OPEN once open_s passed
        return sorted(n for n, b in self.breakers.items() if b.state is not BreakerState.CLOSED)

    def due_probes(self) -> list[str]:
        """HALF_OPEN replicas with a free probe slot; each is counted as probed (sent) now."""
        now, due = self.clock(), []
        for name, breaker in sorted(self.breakers.items()):
            if breaker.state is not BreakerState.CLOSED and breaker.routable(now):
                breaker.on_send()
                due.append(name)
        return due

    def on_success(self, replica: str) -> None:
        """``replica`` answered a request (status below 500) or a probe."""
        self._get(replica).on_success()

    def on_failure(self, replica: str) -> None:
        """``replica`` failed a request: an error before its first byte, a 5xx answer, a
        stream cut mid-way, or a failed probe."""
        self._get(replica).on_failure(self.clock())

    def trip(self, replica: str) -> None:
        """``replica`` reports an unhealthy engine: open its breaker now (if closed)."""
        self._get(replica).trip(self.clock())

    def states(self) -> dict[str, BreakerState]:
        """Each known replica's breaker state (OPEN turns HALF_OPEN once due)."""
        self.blocked()
        return {name: breaker.state for name, breaker in sorted(self.breakers.items())}
