"""Routing policies by name: ``round_robin``, ``least_loaded``, ``prefix_approx``, ``kv_aware``.

Each is ``choose(replicas, request) -> Decision`` over the healthy replicas. The prefix
policies score every replica as

    score = prefix x share - load x (requests it holds, running or waiting)
            - kv x (KV fraction in use) + session x [the session's last replica]
            + adapter x [the request's adapter is resident there]

where ``share`` is the fraction of the request's blocks cached there, counted only above
``min_share`` (0.5): a prefix of half the prompt or less (a chat template's default system
prompt, say) saves at most half its prefill, less than spreading the load is worth, so such
requests are placed as cold ones. The highest score wins, so with the default weights
(1, 0.5, 0.25, 0.5, 0.25) a replica holding a request's whole prompt keeps winning over an
idle one until it holds two more requests (1.0 / 0.5). Measured on this machine, counting
load per decode slot instead let one replica take every request of a 2-replica cluster
(8 concurrent conversations, 8 slots: at most 1.0 per slot, worth 0.5 < the prefix's 0.9),
which doubled TTFT p50 against round robin: an idle replica's compute is worth more than a
few requests' prefill. A request no replica holds any of (cold), and ties, go to the
replica with the fewest requests so far (``Spread``), so a burst of new conversations does
not pile onto one.
``kv_aware`` reads the replicas' cache events (exact, ``index.py``); ``prefix_approx``
only its own record of where it sent which prefixes (no events needed, stale after
evictions).
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Sequence

from kvserve.router.index import BlockIndex, request_block_hashes
from kvserve.router.state import Decision, ReplicaState, RouteRequest

POLICIES = ("round_robin", "least_loaded", "prefix_approx", "kv_aware")
TIE_EPSILON = 1e-9
MAX_SESSIONS = 100_000              # session keys remembered (oldest forgotten first)


@dataclass(frozen=True)
class RouterWeights:
    """The prefix policies' score weights (see the module docstring)."""

    prefix: float = 1.0
    min_share: float = 0.5
    load: float = 0.5
    kv: float = 0.25
    session: float = 0.5
    adapter: float = 0.25


class NoReplicaError(RuntimeError):
    """No healthy replica to route to."""


def _healthy(replicas: Sequence[ReplicaState]) -> list[ReplicaState]:
    healthy = [r for r in replicas if r.healthy]
    if not healthy:
        raise NoReplicaError("no healthy replica")
    return healthy


class Spread:
    """Breaks ties toward the replica that got the fewest requests so far (then by name)."""

    def __init__(self):
        self.assigned: dict[str, int] = {}

    def pick(self, candidates: Sequence[ReplicaState]) -> ReplicaState:
        chosen = min(candidates, key=lambda r: (self.assigned.get(r.name, 0), r.name))
        self.assigned[chosen.name] = self.assigned.get(chosen.name, 0) + 1
        return chosen


class RoundRobin:
    """Each healthy replica in turn, whatever it holds."""

    name = "round_robin"

    def __init__(self):
        self._turn = itertools.count()

    def choose(self, replicas: Sequence[ReplicaState], request: RouteRequest) -> Decision:
        healthy = sorted(_healthy(replicas), key=lambda r: r.name)
        chosen = healthy[next(self._turn) % len(healthy)]
        return Decision(chosen.name, self.name, "round_robin")


class LeastLoaded:
    """The replica with the fewest requests per decode slot (then the least KV in use)."""

    name = "least_loaded"

    def __init__(self):
        self.spread = Spread()

    def choose(self, replicas: Sequence[ReplicaState], request: RouteRequest) -> Decision:
        healthy = _healthy(replicas)
        best = min((r.load, r.kv_usage) for r in healthy)
        chosen = self.spread.pick([r for r in healthy if (r.load, r.kv_usage) == best])
        return Decision(chosen.name, self.name, "least_loaded")


class PrefixAware:
    """Most cached blocks, load considered (the module docstring's score). ``learn``: record
    each choice in the index (``prefix_approx``); otherwise the runtime feeds the index
    with the replicas' cache events (``kv_aware``)."""

    def __init__(self, name: str, block_size: int, weights: RouterWeights, index: BlockIndex, learn: bool):
        self.name, self.block_size, self.weights = name, block_size, weights
        self.index, self.learn = index, learn
        self.spread = Spread()
        self.sessions: dict[str, str] = {}      # session key -> the replica it last went to

    def counted_share(self, matched: int, num_blocks: int) -> float:
        """The cached share of the request's blocks, 0 unless above ``min_share``."""
        share = matched / num_blocks if num_blocks else 0.0
        return share if share > self.weights.min_share else 0.0

    def score(self, replica: ReplicaState, matched: int, num_blocks: int, request: RouteRequest) -> float:
        """The module docstring's score of ``replica`` for ``request``."""
        w = self.weights
        cached = self.counted_share(matched, num_blocks)
        session = request.session_key is not None and self.sessions.get(request.session_key) == replica.name
        adapter = request.namespace.adapter_id
        resident = adapter is not None and adapter in replica.resident_adapters
        return (w.prefix * cached - w.load * (replica.num_running + replica.num_waiting) - w.kv * replica.kv_usage
                + w.session * session + w.adapter * resident)

    def choose(self, replicas: Sequence[ReplicaState], request: RouteRequest) -> Decision:
        healthy = _healthy(replicas)
        hashes = request_block_hashes(request.token_ids, request.namespace, self.block_size)
        matched = {r.name: self.index.prefix_length(r.name, hashes) for r in healthy}
        scores = {r.name: self.score(r, matched[r.name], len(hashes), request) for r in healthy}
        best = max(scores.values())
        tied = [r for r in healthy if scores[r.name] >= best - TIE_EPSILON]
        chosen = self.spread.pick(tied)
        reason = self._reason(chosen, self.counted_share(matched[chosen.name], len(hashes)) > 0, request,
                              len(tied) > 1)
        if self.learn:
            self.index.record(chosen.name, hashes)
        self._remember_session(request.session_key, chosen.name)
        return Decision(chosen.name, self.name, reason, matched[chosen.name], len(hashes))

    def _reason(self, chosen: ReplicaState, by_prefix: bool, request: RouteRequest, tied: bool) -> str:
        if by_prefix:
            return "prefix"
        if request.session_key is not None and self.sessions.get(request.session_key) == chosen.name:
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
                max_history_blocks: int = 1 << 20):
    """The policy called ``name`` (one of ``POLICIES``). ``block_size``: the engines' KV block
    size (the prefix policies hash requests by it); ``max_history_blocks``: ``prefix_approx``'s
    bound on the blocks it remembers per replica."""
    weights = weights or RouterWeights()
    if name == "round_robin":
        return RoundRobin()
    if name == "least_loaded":
        return LeastLoaded()
    if name == "prefix_approx":
        return PrefixAware(name, block_size, weights, BlockIndex(max_history_blocks), learn=True)
    if name == "kv_aware":
        return PrefixAware(name, block_size, weights, BlockIndex(), learn=False)
    raise ValueError(f"unknown router policy {name!r}; choose one of {', '.join(POLICIES)}")
