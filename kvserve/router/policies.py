"""Routing policies by name: ``round_robin``, ``least_loaded``, ``prefix_approx``, ``kv_aware``.

Each is ``choose(replicas, request) -> Decision`` over the routable replicas (healthy, and
their circuit breaker closed: ``ReplicaState.routable``). The prefix
policies estimate what placing the request on each replica costs, in prompt tokens of
prefill (the work that stands between a request and its first token), and take the
cheapest:

    cost = prefill x (the request's tokens that replica must compute: not in its cache)
         + queued  x (prompt tokens waiting there ahead of it)
         + request x (requests it holds, running or waiting)
         + kv      x (fraction of its KV in use)
         - session x [the session's last replica] - adapter x [the request's adapter resident]

Default weights (``RouterWeights``): 1, 1, 32, 64, 64 and 256 tokens. Why 32 per request
held: a prefill token costs ~5 ms on one core here (135M parameters x 2 FLOP at ~55
GFLOP/s), and a request already running there shares every step with this one's prefill
and then with its decode; 32 tokens (~0.16 s) per held request keeps conversations on the
replica holding their history (a 1,000-token history outweighs 30 held requests) while
a cold request, which costs the same everywhere, goes to the least busy replica. A share
of the prompt that every replica holds (a shared system prompt) costs the same
everywhere and so does not pull. Cold requests and ties go to the replica with the
fewest requests so far (``Spread``), so a burst of new conversations does not pile onto
one. Measured (benchmarks/cluster_routing.json): a share-based score (prefix share
against 0.5 per request held) lost to round robin; this cost in tokens does not.
``kv_aware`` reads the replicas' cache events (exact, ``index.py``) and, until their next
report, predicts that a replica holds the prompt blocks of the requests just sent to it
(``PREDICTION_TTL_S``); ``prefix_approx`` only its own record of where it sent which
prefixes (no events needed, stale after evictions).
"""
from __future__ import annotations

import itertools
import time
from dataclasses import dataclass
from typing import Callable, Sequence

from kvserve.router.index import BlockIndex, request_block_hashes
from kvserve.router.state import Decision, ReplicaState, RouteRequest

POLICIES = ("round_robin", "least_loaded", "prefix_approx", "kv_aware")
TIE_EPSILON = 1e-9
MAX_SESSIONS = 100_000              # session keys remembered (oldest forgotten first)
PREDICTION_TTL_S = 5.0              # kv_aware: a sent request's blocks count as held until its replica reports


@dataclass(frozen=True)
class RouterWeights:
    """The prefix policies' cost weights, in prompt tokens (see the module docstring)."""

    prefill: float = 1.0        # per token of the request the replica must compute
    queued: float = 1.0         # per prompt token waiting there already
    request: float = 32.0       # per request it holds (running or waiting)
    kv: float = 64.0            # at 100% of its KV in use
    session: float = 64.0       # taken off: the session's last replica
    adapter: float = 256.0      # taken off: the request's LoRA adapter is resident there

    @classmethod
    def parse(cls, text: str | None) -> "RouterWeights":
        """From ``"prefill=1,request=16"`` (unnamed weights keep their defaults)."""
        values = {}
        for item in filter(None, (part.strip() for part in (text or "").split(","))):
            name, _, value = item.partition("=")
            if name.strip() not in cls.__dataclass_fields__:
                raise ValueError(f"unknown router weight {name.strip()!r}; known: "
                                 f"{', '.join(cls.__dataclass_fields__)}")
            values[name.strip()] = float(value)
        return cls(**values)


class NoReplicaError(RuntimeError):
    """No routable replica (healthy with its breaker closed) to route to."""


def _routable(replicas: Sequence[ReplicaState]) -> list[ReplicaState]:
    """The replicas a policy may choose: healthy, their circuit breaker closed."""
    routable = [r for r in replicas if r.routable]
    if not routable:
        raise NoReplicaError("no routable replica (all unhealthy or their circuit breakers open)")
    return routable


class Spread:
    """Breaks ties toward the replica that got the fewest requests so far (then by name)."""

    def __init__(self):
        self.assigned: dict[str, int] = {}

    def pick(self, candidates: Sequence[ReplicaState]) -> ReplicaState:
        chosen = min(candidates, key=lambda r: (self.assigned.get(r.name, 0), r.name))
        self.assigned[chosen.name] = self.assigned.get(chosen.name, 0) + 1
        return chosen


class RoundRobin:
    """Each routable replica in turn, whatever it holds."""

    name = "round_robin"

    def __init__(self):
        self._turn = itertools.count()

    def choose(self, replicas: Sequence[ReplicaState], request: RouteRequest) -> Decision:
        healthy = sorted(_routable(replicas), key=lambda r: r.name)
        chosen = healthy[next(self._turn) % len(healthy)]
        return Decision(chosen.name, self.name, "round_robin")


class LeastLoaded:
    """The replica with the fewest requests per decode slot (then the least KV in use)."""

    name = "least_loaded"

    def __init__(self):
        self.spread = Spread()

    def choose(self, replicas: Sequence[ReplicaState], request: RouteRequest) -> Decision:
        healthy = _routable(replicas)
        best = min((r.load, r.kv_usage) for r in healthy)
        chosen = self.spread.pick([r for r in healthy if (r.load, r.kv_usage) == best])
        return Decision(chosen.name, self.name, "least_loaded")


class PrefixAware:
    """The cheapest replica by the module docstring's cost. ``learn``: record each choice in
    the index (``prefix_approx``); otherwise the runtime feeds the index with the replicas'
    cache events (``kv_aware``) and each choice is a prediction until they report."""

    def __init__(self, name: str, block_size: int, weights: RouterWeights, index: BlockIndex, learn: bool,
                 clock: Callable[[], float] = time.monotonic):
        self.name, self.block_size, self.weights = name, block_size, weights
        self.index, self.learn, self.clock = index, learn, clock
        self.spread = Spread()
        self.sessions: dict[str, str] = {}      # session key -> the replica it last went to

    def cost(self, replica: ReplicaState, matched_blocks: int, request: RouteRequest) -> float:
        """The module docstring's cost of placing ``request`` on ``replica``, in prompt tokens."""
        w = self.weights
        uncached = max(0, len(request.token_ids) - matched_blocks * self.block_size)
        session = request.session_key is not None and self.sessions.get(request.session_key) == replica.name
        adapter = request.namespace.adapter_id
        resident = adapter is not None and adapter in replica.resident_adapters
        return (w.prefill * uncached + w.queued * replica.queued_tokens
                + w.request * (replica.num_running + replica.num_waiting) + w.kv * replica.kv_usage
                - w.session * session - w.adapter * resident)

    def choose(self, replicas: Sequence[ReplicaState], request: RouteRequest) -> Decision:
        healthy = _routable(replicas)
        now = self.clock()
        self.index.expire_predictions(now)
        hashes = request_block_hashes(request.token_ids, request.namespace, self.block_size)
        matched = {r.name: self.index.prefix_length(r.name, hashes) for r in healthy}
        costs = {r.name: self.cost(r, matched[r.name], request) for r in healthy}
        best = min(costs.values())
        tied = [r for r in healthy if costs[r.name] <= best + TIE_EPSILON]
        chosen = self.spread.pick(tied)
        reason = self._reason(chosen.name, matched, request, len(tied) > 1)
        if self.learn:
            self.index.record(chosen.name, hashes)
        else:
            self.index.predict(chosen.name, hashes, now + PREDICTION_TTL_S)
        self._remember_session(request.session_key, chosen.name)
        return Decision(chosen.name, self.name, reason, matched[chosen.name], len(hashes),
                        matched[chosen.name] * self.block_size)

    def _reason(self, chosen: str, matched: dict[str, int], request: RouteRequest, tied: bool) -> str:
        if matched[chosen] > min(matched.values()):
            return "prefix"
        if request.session_key is not None and self.sessions.get(request.session_key) == chosen:
            return "session"
        return "spread" if tied else "least_loaded"

    def _remember_session(self, key: str | None, replica: str) -> None:
        if key is None:
            return
        self.sessions.pop(key, None)
        self.sessions[key] = replica
        if len(self.sessions) > MAX_SESSIONS:
            del self.sessions[next(iter(self.sessions))]


def make_policy(name: str, block_size: int = 16, weights: RouterWeights | None = None,
                max_history_blocks: int = 1 << 20, clock: Callable[[], float] = time.monotonic):
    """The policy called ``name`` (one of ``POLICIES``). ``block_size``: the engines' KV block
    size (the prefix policies hash requests by it); ``max_history_blocks``: ``prefix_approx``'s
    bound on the blocks it remembers per replica; ``clock``: the prefix policies' time for
    their predictions (a simulator passes its own)."""
    weights = weights or RouterWeights()
    if name == "round_robin":
        return RoundRobin()
    if name == "least_loaded":
        return LeastLoaded()
    if name == "prefix_approx":
        return PrefixAware(name, block_size, weights, BlockIndex(max_history_blocks), learn=True, clock=clock)
    if name == "kv_aware":
        return PrefixAware(name, block_size, weights, BlockIndex(), learn=False, clock=clock)
    raise ValueError(f"unknown router policy {name!r}; choose one of {', '.join(POLICIES)}")
