"""What the router knows of a deployment's replicas when it places a request.

``FreshView`` (the default): each replica's state at the instant of the decision, as a router
that counts its own requests would know it. ``StaleView``: the view Ray Serve gives the local
cluster's router (``cluster/ray_router.py``). Its controller records each replica's stats
(requests running and waiting, KV use, queued prompt tokens) every ``period_s`` and the
router sees them ``delay_s`` later; to a replica's waiting requests the router adds those it
sent after the stats were taken (their prompt tokens to its queued tokens). So a request that
finished since the stats still counts, and within one period a burst can be placed on the
replica whose stats are older. The cluster measures the stats' age at each decision
(``kvserve_router_stats_age_seconds``); a decision at a uniformly random instant sees stats
``delay_s + period_s / 2`` old on average (``delay_from_mean_age``).

The deployment asks a view to ``fill`` each ready replica's ``ReplicaState`` before a decision
and tells it where each request went (``routed``); ``snapshot`` is the controller's record,
which the fleet loop calls every ``period_s`` (``StaleView`` only).
"""
from __future__ import annotations

from collections import deque

from kvserve.router.state import ReplicaState


class FreshView:
    """Every replica as it is now."""

    period_s = None

    def fill(self, state: ReplicaState, replica, now: float) -> None:
        """Set ``state`` (``replica``'s, for the router's policy) as the router sees it at ``now``."""
        state.num_running, state.num_waiting = replica.num_running, replica.num_waiting
        state.kv_usage, state.queued_tokens = replica.kv_usage, replica.queued_tokens

    def routed(self, name: str, now: float, tokens: int) -> None:
        """A request with ``tokens`` uncached prompt tokens was sent to replica ``name`` at ``now``."""

    def snapshot(self, replicas, now: float) -> None:
        """The controller records ``replicas``' stats at ``now`` (nothing to record: the view is live)."""

    def forget(self, name: str) -> None:
        """Replica ``name`` left the deployment."""


class StaleView:
    """Stats recorded every ``period_s``, seen ``delay_s`` later, plus the requests sent since."""

    def __init__(self, period_s: float, delay_s: float):
        if period_s <= 0 or delay_s < 0:
            raise ValueError("the stats' period must be positive and their delay not negative")
        self.period_s, self.delay_s = period_s, delay_s
        self.stats: dict[str, deque] = {}     # replica -> (recorded at, running, waiting, kv use, queued tokens)
        self.sent: dict[str, deque] = {}      # replica -> (sent at, uncached prompt tokens)

    def snapshot(self, replicas, now: float) -> None:
        for r in replicas:
            recorded = self.stats.setdefault(r.name, deque())
            recorded.append((now, r.num_running, r.num_waiting, r.kv_usage, r.queued_tokens))
            while len(recorded) > 1 and recorded[1][0] + self.delay_s <= now:
                recorded.popleft()             # an older record than the one the router sees now

    def _visible(self, name: str, now: float) -> tuple:
        recorded = self.stats.get(name, ())
        seen = [s for s in recorded if s[0] + self.delay_s <= now]
        return seen[-1] if seen else (float("-inf"), 0, 0, 0.0, 0)   # no stats yet: only what was sent

    def fill(self, state: ReplicaState, replica, now: float) -> None:
        at, running, waiting, kv_usage, queued = self._visible(replica.name, now)
        sent = [tokens for t, tokens in self.sent.get(replica.name, ()) if t > at]
        state.num_running, state.num_waiting = running, waiting + len(sent)
        state.kv_usage, state.queued_tokens = kv_usage, queued + sum(sent)

    def routed(self, name: str, now: float, tokens: int) -> None:
        sent = self.sent.setdefault(name, deque())
        sent.append((now, tokens))
        while sent and sent[0][0] < now - 2 * (self.period_s + self.delay_s):
            sent.popleft()                     # older than any record the router can still see

    def forget(self, name: str) -> None:
        self.stats.pop(name, None)
        self.sent.pop(name, None)


def delay_from_mean_age(mean_age_s: float, period_s: float) -> float:
    """The stats' delay from their mean age at the decisions (``delay + period / 2``), at least 0."""
    return max(0.0, mean_age_s - period_s / 2)


def router_view(period_s: float | None, delay_s: float = 0.0):
    """``StaleView(period_s, delay_s)``, or ``FreshView()`` without a period."""
    return FreshView() if period_s is None else StaleView(period_s, delay_s)
