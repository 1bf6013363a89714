"""The discrete-event loop: a day of requests through the deployments, the autoscalers and
the residency tiers of one fleet policy.

Events, in time order (ties by insertion): a request's arrival (routed or queued; a
closed-loop conversation's turn held back until its previous answer ended is pushed as an
event, ``conversations.TurnGate``), a replica's segment end (``BatchReplica.complete``; the
slots of the requests it finished go to the deployment's queue), a replica becoming ready, the
autoscaler tick (every ``autoscale_interval_s`` from ``autoscale_first_tick_s``: queued
requests past their wait are rejected, then each model's replicas are read), the decision on
that reading (``ModelScaler.decide``, applied at once) ``decision_delay_s`` after it, the age of
the metrics a real controller decides from, a down step falling due between two decisions (the
scaler re-decides on the input it holds, ``ModelScaler.recheck``, as kvserve's policy does on
every tick of Ray Serve's controller), the re-tiering tick (every ``retier_interval_s``) and,
with ``router_stats_period_s``, the record of the replicas' stats the routers see
(``router_view.StaleView``). No
clock is read and every choice is ordered, so the same scenario gives the same result.
"""
from __future__ import annotations

import heapq
import itertools
import math

from kvserve.autoscale.residency import RetierConfig, retier
from kvserve.autoscale.tiers import ResidencyTier
from kvserve.fleetsim.conversations import TurnGate
from kvserve.fleetsim.deployment import Deployment
from kvserve.fleetsim.log import RequestLog
from kvserve.fleetsim.replica import BatchReplica
from kvserve.fleetsim.router_view import router_view
from kvserve.fleetsim.scaling import POLICIES, ModelScaler, replicas_for_rate
from kvserve.fleetsim.scenario import Scenario
from kvserve.fleetsim.sizing import ReplicaSizing

REPLICA, READY, TICK, RETIER, DECIDE, ARRIVE, STATS, DOWN_DUE = 0, 1, 2, 3, 4, 5, 6, 7
TIMELINE_EVERY_S = 300.0


class FleetSim:
    """One policy over one scenario's requests; ``run()`` fills the log and returns the fleet's record.
    ``host``: one ``host_cpu.SharedHost`` all deployments' replicas share (the local-cluster check);
    ``router``: the router's policy each deployment places requests by; ``initial_replicas``: each
    model's replicas at the start (default: by the policy, ``_initial_replicas``)."""

    def __init__(self, scenario: Scenario, policy: str, sizings: list[ReplicaSizing], log: RequestLog,
                 planned: dict[str, ResidencyTier], peak_rps: list[float], initial_rps: list[float],
                 replica_factory=BatchReplica, host=None, router: str = "least_loaded",
                 initial_replicas: list[int] | None = None):
        self.scenario, self.policy, self.log = scenario, POLICIES[policy], log
        self.planned = planned
        self.heap: list = []
        self.order = itertools.count()
        self.deployments, self.scalers = [], []
        for i, (sizing, model) in enumerate(zip(sizings, scenario.models)):
            tier = self._initial_tier(model.name)
            dep = Deployment(i, sizing, tier, log, replica_factory, router, scenario.ingress_slots, host,
                             session_keys=model.session_keys,
                             view=router_view(scenario.router_stats_period_s, scenario.router_stats_delay_s))
            wanted = (initial_replicas[i] if initial_replicas is not None
                      else self._initial_replicas(tier, sizing, model, peak_rps[i], initial_rps[i]))
            for _ in range(wanted):
                name, _ready = dep.start_replica(0.0)
                self._push(0.0, READY, i, name)
            self.deployments.append(dep)
            self.scalers.append(ModelScaler(self.policy, sizing, scenario.headroom, scenario.downscale_window_s,
                                            scenario.max_replicas, wanted, scenario.log_demand_windows))
        self.retier_config = RetierConfig(host_cache_bytes=scenario.host_cache_bytes)
        self.timeline: list[tuple[float, dict[str, int]]] = []
        self.serving: list[tuple[float, tuple[int, ...]]] = [(0.0, self._serving())]
        self.rejected = 0
        gaps = [m.turn_gap_s if m.closed_loop else None for m in scenario.models]
        self.turns = TurnGate(log, gaps) if any(g is not None for g in gaps) else None

    def _initial_tier(self, name: str) -> ResidencyTier:
        if self.policy.tiers == "peak":
            return ResidencyTier.HOT
        if self.policy.tiers == "cold":
            return ResidencyTier.COLD
        return self.planned[name]

    def _initial_replicas(self, tier, sizing, model, peak_rps: float, initial_rps: float) -> int:
        """Always on: the peak's replicas; otherwise a hot model starts the day with what its first
        minute needs (at least one), warm and cold ones with none."""
        h = self.scenario.headroom
        if self.policy.tiers == "peak":
            return max(1, replicas_for_rate(peak_rps, sizing, model.mean_prompt_len, model.output_tokens, h))
        if tier is ResidencyTier.HOT:
            return max(1, replicas_for_rate(initial_rps, sizing, model.mean_prompt_len, model.output_tokens, h))
        return 0

    def _push(self, t: float, kind: int, a, b) -> None:
        heapq.heappush(self.heap, (t, next(self.order), kind, a, b))

    def _replica_event(self, replica, t: float | None) -> None:
        if t is not None:
            replica.version += 1
            self._push(t, REPLICA, replica, replica.version)

    # -- the loop -------------------------------------------------------------------------------
    def run(self) -> dict:
        s = self.scenario
        if self.policy.signal is not None:
            first = s.autoscale_interval_s if s.autoscale_first_tick_s is None else s.autoscale_first_tick_s
            self._push(first, TICK, None, None)
        if self.policy.tiers == "planned":
            self._push(s.retier_interval_s, RETIER, None, None)
        if s.router_stats_period_s is not None:
            self._push(0.0, STATS, None, None)
        arrival, heap, turns = self.log.arrival, self.heap, self.turns
        for request in range(len(arrival)):
            t_next = arrival[request]
            while heap and heap[0][0] <= t_next:
                self._handle(heapq.heappop(heap))
            send = t_next if turns is None else turns.send_time(request)
            if send == t_next:
                self._arrive(request, t_next)
            elif send is not None:
                self._push(send, ARRIVE, request, None)
        while heap:
            self._handle(heapq.heappop(heap))
        end = max(s.duration_s, max((self.log.finish_s[i] for i in range(len(arrival))), default=0.0))
        for dep in self.deployments:
            dep.account(end)
        return {"end_s": end, "timeline": self.timeline, "serving": self.serving, "rejected": self.rejected,
                "windows": [scaler.windows for scaler in self.scalers]}

    def _arrive(self, request: int, now: float) -> None:
        """``request`` is sent at ``now``: routed, or queued (starting a replica if none is)."""
        self.log.arrival[request] = now
        dep = self.deployments[self.log.model[request]]
        routed = dep.arrive(request, now)
        if routed is not None:
            self._replica_event(*routed)
        elif not dep.ready:
            self._scale_from_zero(dep, now)

    def _handle(self, event) -> None:
        self._dispatch(event)
        if self.turns is not None:
            for send, request in self.turns.released():
                self._push(send, ARRIVE, request, None)

    def _dispatch(self, event) -> None:
        t, _, kind, a, b = event
        if kind == ARRIVE:
            self._arrive(a, t)
        elif kind == REPLICA:
            if a.version == b:
                finished = a.finished_total
                self._replica_event(a, a.complete(t))
                dep = self.deployments[a.owner]
                if a.finished_total > finished:
                    for replica, nxt in dep.finished(a.finished_total - finished, t):
                        self._replica_event(replica, nxt)
                if a.idle and dep.draining:
                    dep.release_drained(t)
        elif kind == READY:
            dep = self.deployments[a]
            for replica, nxt in dep.replica_ready(b, t):
                self._replica_event(replica, nxt)
            self._note_serving(t)
        elif kind == TICK:
            self._tick(t)
            self._note_serving(t)
        elif kind == DECIDE:
            self._decide(self.deployments[a], self.scalers[a], b, t)
            self._note_serving(t)
        elif kind == STATS:
            self._record_stats(t)
        elif kind == DOWN_DUE:
            self._recheck(self.deployments[a], self.scalers[a], t)
            self._note_serving(t)
        else:
            self._retier(t)

    def _record_stats(self, now: float) -> None:
        """The controller records every ready replica's stats for the routers (``router_view``),
        and again a period later while the trace runs or anything else is due."""
        for dep in self.deployments:
            dep.view.snapshot(dep.ready, now)
        period = self.scenario.router_stats_period_s
        if now + period <= self.scenario.duration_s or self.heap:
            self._push(now + period, STATS, None, None)

    def _scale_from_zero(self, dep: Deployment, now: float) -> None:
        """A request for a model with no replica: start one now unless one is starting."""
        if not dep.starting:
            name, ready = dep.start_replica(now)
            self._push(ready, READY, dep.index, name)

    def _tick(self, now: float) -> None:
        s = self.scenario
        for dep, scaler in zip(self.deployments, self.scalers):
            self.rejected += dep.expire_queue(now, s.max_queue_wait_s)
            if not dep.held and not dep.queue and dep.tier is not ResidencyTier.HOT:
                continue                       # nothing runs or waits: desired is 0 (bounds allow it)
            reading = (now, dep.counters(now), dep.queued_without_replica)
            if s.decision_delay_s > 0:
                self._push(now + s.decision_delay_s, DECIDE, dep.index, reading)
            else:
                self._decide(dep, scaler, reading, now)
        if math.fmod(now, TIMELINE_EVERY_S) < s.autoscale_interval_s:
            self.timeline.append((now, self._gpus_by_tier()))
        if now + s.autoscale_interval_s <= s.duration_s:
            self._push(now + s.autoscale_interval_s, TICK, None, None)

    def _decide(self, dep: Deployment, scaler: ModelScaler, reading: tuple, now: float) -> None:
        """Decide at ``now`` on ``reading`` (its time, the replicas' counters, the requests queued
        with no replica) and apply it; re-decide when a down step falls due before the next decision."""
        read_at, counters, queued = reading
        self._apply(dep, scaler.decide(now, dep.tier, dep.active, counters, queued, read_at), now)
        self._watch_down_due(dep, scaler, now)

    def _recheck(self, dep: Deployment, scaler: ModelScaler, now: float) -> None:
        """A down step due between two decisions: the scaler re-decides on the input it holds."""
        if dep.held:
            self._apply(dep, scaler.recheck(now, dep.tier, dep.active), now)
            self._watch_down_due(dep, scaler, now)

    def _watch_down_due(self, dep: Deployment, scaler: ModelScaler, now: float) -> None:
        due = scaler.down_due_s()
        if due is not None and now < due < now + self.scenario.autoscale_interval_s:
            self._push(due, DOWN_DUE, dep.index, None)

    def _apply(self, dep: Deployment, want: int, now: float) -> None:
        """Start or stop replicas so ``dep`` has ``want`` (serving + starting)."""
        if want > dep.active:
            for _ in range(want - dep.active):
                name, ready = dep.start_replica(now)
                self._push(ready, READY, dep.index, name)
        elif want < dep.active:
            dep.stop_replicas(dep.active - want, now)

    def _serving(self) -> tuple[int, ...]:
        return tuple(len(dep.ready) for dep in self.deployments)

    def _note_serving(self, now: float) -> None:
        """Record each model's serving replicas (ready, not starting or draining) when they change:
        the step function a cluster's replica count over time is compared with."""
        counts = self._serving()
        if counts != self.serving[-1][1]:
            self.serving.append((now, counts))

    def _gpus_by_tier(self) -> dict[str, int]:
        gpus = {t.value: 0 for t in ResidencyTier}
        for dep in self.deployments:
            gpus[dep.tier.value] += dep.held * dep.sizing.tp
        return gpus

    def _retier(self, now: float) -> None:
        s = self.scenario
        names = [m.name for m in s.models]
        load = {}
        for name, dep in zip(names, self.deployments):
            cap = dep.sizing.capacity
            load[name] = (dep.window_tokens[0] / cap.prefill_tokens_per_s
                          + dep.window_tokens[1] / cap.decode_tokens_per_s) / s.retier_interval_s
            dep.window_tokens = [0, 0]
        current = {name: dep.tier for name, dep in zip(names, self.deployments)}
        tiers = retier(current, self.planned, load, {n: d.sizing.weight_bytes for n, d in zip(names, self.deployments)},
                       self.retier_config)
        for name, dep in zip(names, self.deployments):
            if tiers[name] is not dep.tier:
                dep.account(now)
                dep.tier = tiers[name]
        if now + s.retier_interval_s <= s.duration_s:
            self._push(now + s.retier_interval_s, RETIER, None, None)
