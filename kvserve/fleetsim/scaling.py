"""The fleet policies the simulator compares, each built from kvserve's own autoscaling parts.

- ``always_on``: every model keeps the replicas its peak needs all day (``ceil(peak load x
  headroom)``, load from the planner's capacity at the SLO); no autoscaling.
- ``scale_to_zero``: every model cold (may scale to zero), token-based autoscaling.
- ``tiers_tokens``: residency tiers (planned by ``kvserve plan --fleet``, then re-tiered from
  measured popularity with hysteresis, ``autoscale/residency.py``) and token-based autoscaling.
- ``tiers_requests``: the same tiers and Ray Serve's request-count rule (``target_ongoing_requests``
  = 80% of a replica's batch at the TPOT SLO), on the ongoing requests averaged over the interval
  (Ray Serve averages over a look-back window; one instant between requests reads 0).

``ModelScaler`` holds one model's autoscaler: each interval it scrapes the replicas' counters
(``autoscale/signals.FleetScrape``), computes the policy's desired count and stabilises it
(``autoscale/policy``, ``autoscale/stabilize``) within the tier's bounds (``bounds_for_tier``).
Between two intervals it holds that input, as kvserve's policy on Ray Serve does (the
controller calls it every ~0.1 s tick; the demand changes only when a window closes), so a down
step falls due when the stabiliser's window has passed (``down_due_s``, ``recheck``), not at the
next interval after it.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace

from kvserve.autoscale.policy import RequestCountPolicy, TokenPolicy
from kvserve.autoscale.signals import FleetScrape, ReplicaCounters, token_demand
from kvserve.autoscale.stabilize import ScaleState, StabilizerConfig
from kvserve.autoscale.tiers import bounds_for_tier
from kvserve.fleetsim.sizing import ReplicaSizing

REQUEST_TARGET_SHARE = 0.8      # the request-count baseline's target: this share of a replica's batch


@dataclass(frozen=True)
class FleetPolicy:
    """``signal``: "tokens", "requests" or None (fixed count); ``tiers``: "peak" (always on),
    "cold" (everything may scale to zero) or "planned" (residency tiers)."""

    name: str
    signal: str | None
    tiers: str


POLICIES = {
    "always_on": FleetPolicy("always_on", None, "peak"),
    "scale_to_zero": FleetPolicy("scale_to_zero", "tokens", "cold"),
    "tiers_requests": FleetPolicy("tiers_requests", "requests", "planned"),
    "tiers_tokens": FleetPolicy("tiers_tokens", "tokens", "planned"),
}


def replicas_for_rate(rps: float, sizing: ReplicaSizing, prompt: float, output: float, headroom: float) -> int:
    """``ceil((rps x prompt / C_p + rps x output / C_d) x headroom)``: replicas for a request rate."""
    load = rps * prompt / sizing.capacity.prefill_tokens_per_s + rps * output / sizing.capacity.decode_tokens_per_s
    return max(0, math.ceil(load * headroom - 1e-9))


class ModelScaler:
    """One model's autoscaler in the simulation (the module docstring)."""

    def __init__(self, policy: FleetPolicy, sizing: ReplicaSizing, headroom: float, downscale_window_s: float,
                 max_replicas: int, replicas: int, log_windows: bool = False):
        stabilizer = StabilizerConfig(downscale_window_s=downscale_window_s)
        self.signal = policy.signal
        self.token_policy = TokenPolicy(sizing.capacity, headroom, stabilizer)
        self.request_policy = RequestCountPolicy(max(1.0, REQUEST_TARGET_SHARE * sizing.max_num_seqs), stabilizer)
        self.max_replicas = max_replicas
        self.state = ScaleState(replicas)
        self.scrape = FleetScrape(0.0)
        self.held: dict[str, float] = {}            # replica -> request-seconds held at the last decision
        self.input = None                           # the last decision's demand (tokens) or ongoing requests
        # with ``log_windows``: each token window closed, (read at, decided at, prefill tokens/s, decode tokens/s)
        self.windows: list[tuple[float, float, float, float]] | None = [] if log_windows else None

    def decide(self, now: float, tier, active: int, counters: dict, queued: int, read_at: float | None = None) -> int:
        """The replica count for ``now`` from the replicas' counters (name -> (prompt tokens computed,
        output tokens, running, waiting, request-seconds held, queued prompt tokens)) and ``queued``
        requests waiting for a replica, read at ``read_at`` (``now`` when None)."""
        read_at = now if read_at is None else read_at
        scrape = FleetScrape(read_at, {name: ReplicaCounters(p, 0.0, g, run, wait, backlog)
                                       for name, (p, g, run, wait, _, backlog) in counters.items()}, queued)
        if self.signal == "tokens":
            if read_at <= self.scrape.time_s:
                return active
            self.input = token_demand(self.scrape, scrape)
            if self.windows is not None:
                self.windows.append((read_at, now, self.input.prefill_tokens_per_s, self.input.decode_tokens_per_s))
        else:
            self.input = self._mean_ongoing(read_at, counters, queued)
        self.scrape = scrape
        return self.recheck(now, tier, active)

    def recheck(self, now: float, tier, active: int) -> int:
        """The replica count for ``now`` on the input of the last ``decide`` (none yet: ``active``)."""
        if self.input is None:
            return active
        bounds = bounds_for_tier(tier, self.max_replicas)
        state = replace(self.state, replicas=active)
        policy = self.token_policy if self.signal == "tokens" else self.request_policy
        decision, self.state, _ = policy.decide(state, now, self.input, bounds)
        return decision.replicas

    def down_due_s(self) -> float | None:
        """When the stabiliser's next down step falls due if the held input stays (None: no count
        is waiting to go down)."""
        state, config = self.state, self.token_policy.stabilizer
        if state.below_since_s is None:
            return None
        due = state.below_since_s + config.downscale_window_s
        return due if state.last_down_s is None else max(due, state.last_down_s + config.step_interval_s)

    def _mean_ongoing(self, now: float, counters: dict, queued: int) -> float:
        """Requests held per second since the last decision, summed over replicas, plus the queue."""
        window = now - self.scrape.time_s
        held = {name: c[4] for name, c in counters.items()}
        mean = sum(h - self.held.get(name, 0.0) for name, h in held.items()) / window if window > 0 else 0.0
        self.held = held
        return max(0.0, mean) + queued
