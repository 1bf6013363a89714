"""``KVServeRequestRouter``: Ray Serve's request router for ``EngineReplica``, deciding with
a ``kvserve.router`` policy from the replicas' routing stats (``record_routing_stats``:
load, KV use, the cached blocks' hashes) and the ``route`` the ingress computed for the
request (its prompt's tokens, tenant salt, session key), never choosing a replica whose
circuit breaker the ingress holds open (``route["blocked"]``). Ray Serve's router API is
alpha: ray[serve] is pinned (pyproject's ``cluster`` extra).

The router reports each decision by writing it into the request's ``route`` (``route
["decision"]``: replica, policy, reason, cached tokens, the replicas it saw, those that
reported an unhealthy engine, the KV use of the fullest one, for the degradation ladder, and
how old each replica's stats were: Ray Serve's controller records them every
``request_routing_stats_period_s`` and broadcasts them, so the router decides on a view up to a
period and the broadcast old, which the fleet simulator's router view models). Ray Serve 2.60
runs a handle's request router in the process that holds the handle (the ingress), hands
``choose_replicas`` the caller's keyword arguments (a shallow copy: ``route`` is the
ingress's own dict) and serialises them only when it sends the request, so the ingress reads
the decision there, even when the replica fails, and counts it in its metrics
(``cluster/metrics.py``)."""
from __future__ import annotations

import logging
import time
from collections import deque
from typing import List, Optional

from ray.serve.request_router import PendingRequest, RequestRouter, RunningReplica

from kvserve.engine.kv.cache_events import CacheNamespace
from kvserve.router import Decision, ReplicaState, RouteRequest, RouterWeights, make_policy
from kvserve.router.state import adapter_identity
from kvserve.router.policies import PrefixAware

logger = logging.getLogger("kvserve.cluster")
STALE_ROUTED_S = 10.0        # a sent request not yet in any stats after this long is forgotten


class KVServeRequestRouter(RequestRouter):
    """Ranks the chosen replica first and the rest after it (Ray Serve falls back to them
    if the first cannot take the request)."""

    def initialize_state(self, policy: str = "kv_aware", weights: str | None = None, block_size: int = 16):
        self.policy = make_policy(policy, block_size, RouterWeights.parse(weights))
        self._blocks_seen: dict[str, float] = {}     # replica -> stats time its blocks were read at
        self._routed: dict[str, deque] = {}          # replica -> (wall time, uncached tokens) of requests sent
        self._adapter_ids: dict[str, str] = {}       # LoRA adapter name -> identity, from the replicas' stats

    def _state(self, replica: RunningReplica) -> ReplicaState:
        stats = replica.routing_stats or {}
        name = replica.replica_id.unique_id
        events_fed = isinstance(self.policy, PrefixAware) and not self.policy.learn     # kv_aware
        if events_fed and "blocks" in stats and self._blocks_seen.get(name) != stats.get("time"):
            self.policy.index.forget(name)
            self.policy.index.record(name, stats["blocks"])    # the replica's cache, as its events left it
            self._blocks_seen[name] = stats.get("time")
        self._adapter_ids.update(stats.get("adapter_ids", {}))
        sent, sent_tokens = self._routed_since(name, stats.get("time", 0.0))
        return ReplicaState(name, int(stats.get("num_running", 0)), int(stats.get("num_waiting", 0)) + sent,
                            float(stats.get("kv_usage", 0.0)), int(stats.get("max_num_seqs", 0)),
                            int(stats.get("queued_tokens", 0)) + sent_tokens, frozenset(stats.get("adapters", ())),
                            healthy=bool(stats.get("healthy", True)))

    def _routed_since(self, name: str, stats_time: float) -> tuple[int, int]:
        """Requests (and their uncached prompt tokens) sent to ``name`` after its stats were
        taken: its stats do not count them yet, and without them every request in a stats
        period herds onto the same replica."""
        routed = self._routed.setdefault(name, deque())
        while routed and (routed[0][0] <= stats_time or time.time() - routed[0][0] > STALE_ROUTED_S):
            routed.popleft()
        return len(routed), sum(tokens for _, tokens in routed)

    async def choose_replicas(self, candidate_replicas: List[RunningReplica],
                              pending_request: Optional[PendingRequest] = None) -> List[List[RunningReplica]]:
        """The chosen replica first, the others after it. ``route`` keys read: ``tokens``,
        ``adapter``, ``cache_salt``, ``session`` (the request), ``avoid`` (replicas that failed
        it already), ``blocked`` (breakers not closed), ``replica`` (a pin: the ingress's
        probes and metric scrapes go to exactly that replica while it runs)."""
        if not candidate_replicas:
            return []
        route = pending_request.kwargs.get("route") if pending_request is not None else None
        route = route if isinstance(route, dict) else {}
        states = [self._state(r) for r in candidate_replicas]
        now = time.time()
        ages = [now - r.routing_stats["time"] for r in candidate_replicas if "time" in (r.routing_stats or {})]
        unhealthy = [s.name for s in states if not s.healthy]
        avoid, blocked = set(route.get("avoid", ())), set(route.get("blocked", ()))
        for state in states:
            state.healthy = state.healthy and state.name not in avoid
            state.breaker_open = state.name in blocked
        decision = self._decide(states, route)
        route["decision"] = {"replica": decision.replica if decision else None,
                             "policy": decision.policy if decision else self.policy.name,
                             "reason": decision.reason if decision else "fallback",
                             "cached_tokens": decision.cached_tokens if decision else 0,
                             "replicas": [s.name for s in states], "unhealthy": unhealthy,
                             "kv_usage": max((s.kv_usage for s in states), default=0.0),
                             "stats_age_s": [round(age, 4) for age in ages]}
        if decision is None:
            return [candidate_replicas]              # none routable: let Ray Serve try them all
        chosen = next(r for r in candidate_replicas if r.replica_id.unique_id == decision.replica)
        if decision.reason == "pinned":
            return [[chosen]]                        # no fallback: a probe or scrape is for that replica only
        uncached = max(0, len(route.get("tokens", ())) - decision.cached_tokens)
        self._routed.setdefault(decision.replica, deque()).append((time.time(), uncached))
        logger.debug("routed to %s (%s, %d/%d blocks cached)", decision.replica, decision.reason,
                     decision.matched_blocks, decision.num_blocks)
        routable = {s.name for s in states if s.routable}
        rest = [r for r in candidate_replicas if r is not chosen and r.replica_id.unique_id in routable]
        return [[chosen], rest] if rest else [[chosen]]

    def on_request_routed(self, pending_request: PendingRequest, replica_id, result) -> None:
        """Ray Serve calls this once the replica accepted the request (its first reply, the
        queue-length answer): marked in the request's ``route`` (``route["accepted"]``), so the
        ingress blames a silent reply on the replica only once it had the request (``keepalive.py``)."""
        route = pending_request.kwargs.get("route") if pending_request is not None else None
        if isinstance(route, dict):
            route["accepted"] = True

    def _decide(self, states: List[ReplicaState], route: dict) -> Decision | None:
        """The pinned replica if it runs, else the policy's choice; None when no replica is routable."""
        pinned = route.get("replica")
        if pinned is not None and any(s.name == pinned for s in states):
            return Decision(pinned, self.policy.name, "pinned")
        if not any(s.routable for s in states):
            return None
        adapter = adapter_identity(route.get("adapter"), self._adapter_ids)
        request = RouteRequest(tuple(route.get("tokens", ())),
                               CacheNamespace(adapter, 0, route.get("cache_salt")), route.get("session"))
        return self.policy.choose(states, request)
