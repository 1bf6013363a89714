"""The two autoscaling policies: token-based (ours) and request-count (Ray Serve's baseline).

**Token-based.** With demand ``D_p`` prompt tokens computed/s and ``D_d`` output tokens/s
(``signals.token_demand``) and one replica's capacity at the SLO ``C_p`` and ``C_d``
(``capacity.replica_capacity``), each ratio is the fraction of one replica's time that phase
needs, and the phases share the replica's time, so they add::

    load (replica-equivalents) = D_p / C_p + D_d / C_d
    desired = ceil(load x headroom_factor)              (>= 1 while requests are queued)

``headroom_factor`` >= 1 is the spare capacity kept for bursts and for the time a new replica
takes to start; 1.25 equals the planner's ``--headroom 0.2`` (1 / (1 - 0.2)).

**Request-count baseline** (Ray Serve's default ``target_ongoing_requests`` policy, like KEDA on
``num_requests_waiting``)::

    desired = ceil(ongoing requests / target_ongoing_requests)

It counts requests, not work: one 8k-token prompt weighs as much as a 20-token chat turn.

Both go through the same ``stabilize`` (scale up at once, down after a window, one step at a time)
within the residency tier's bounds. Time is passed in; nothing here reads a clock.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from kvserve.autoscale.capacity import ReplicaCapacity
from kvserve.autoscale.errors import AutoscaleInputError
from kvserve.autoscale.signals import TokenDemand
from kvserve.autoscale.stabilize import ScaleDecision, ScaleState, StabilizerConfig, stabilize
from kvserve.autoscale.tiers import ReplicaBounds
from kvserve.planner.figures import Figure

CEIL_TOLERANCE = 1e-9   # so 3.0000000001 replica-equivalents (float noise) is 3, not 4


def _ceil(value: float) -> int:
    return max(0, math.ceil(value - CEIL_TOLERANCE))


def token_desired_replicas(demand: TokenDemand, capacity: ReplicaCapacity, headroom_factor: float) -> Figure:
    """``ceil((D_p / C_p + D_d / C_d) x headroom_factor)``, at least 1 while requests are queued."""
    if not (headroom_factor >= 1 and math.isfinite(headroom_factor)):
        raise AutoscaleInputError(f"headroom_factor {headroom_factor} must be >= 1", param="headroom_factor")
    prefill_load = demand.prefill_tokens_per_s / capacity.prefill_tokens_per_s
    decode_load = demand.decode_tokens_per_s / capacity.decode_tokens_per_s
    load = prefill_load + decode_load
    value = _ceil(load * headroom_factor)
    text = (f"prefill {demand.prefill_tokens_per_s:,.1f} / {capacity.prefill_tokens_per_s:,.1f} tokens/s = "
            f"{prefill_load:.3f} + decode {demand.decode_tokens_per_s:,.1f} / {capacity.decode_tokens_per_s:,.1f} "
            f"tokens/s = {decode_load:.3f} -> load {load:.3f} replicas x headroom {headroom_factor:g} = "
            f"{load * headroom_factor:.3f} -> ceil {value}")
    if demand.queued_requests > 0 and value < 1:
        value, text = 1, text + f"; {demand.queued_requests} queued requests -> 1"
    return Figure("desired_replicas", float(value), "replicas", text)


def request_desired_replicas(ongoing: float, target_ongoing_requests: float) -> Figure:
    """``ceil(ongoing requests / target_ongoing_requests)`` (Ray Serve's default policy)."""
    if not target_ongoing_requests > 0 or ongoing < 0:
        raise AutoscaleInputError("target_ongoing_requests must be positive and ongoing requests >= 0",
                                  param="target_ongoing_requests")
    value = _ceil(ongoing / target_ongoing_requests)
    return Figure("desired_replicas", float(value), "replicas",
                  f"ceil({ongoing:g} ongoing requests / target {target_ongoing_requests:g}) = {value}")


@dataclass(frozen=True)
class TokenPolicy:
    """The token-based policy for one model: its capacity at the SLO, headroom and stabiliser."""

    capacity: ReplicaCapacity
    headroom_factor: float = 1.25
    stabilizer: StabilizerConfig = StabilizerConfig()

    def decide(self, state: ScaleState, now_s: float, demand: TokenDemand,
               bounds: ReplicaBounds) -> tuple[ScaleDecision, ScaleState, Figure]:
        """Desired replicas from ``demand``, then stabilised: (decision, next state, arithmetic)."""
        desired = token_desired_replicas(demand, self.capacity, self.headroom_factor)
        decision, nxt = stabilize(state, now_s, int(desired.value), bounds, self.stabilizer)
        return decision, nxt, desired


@dataclass(frozen=True)
class RequestCountPolicy:
    """The baseline: Ray Serve's ``target_ongoing_requests`` rule with the same stabiliser."""

    target_ongoing_requests: float = 2.0   # Ray Serve's default
    stabilizer: StabilizerConfig = StabilizerConfig()

    def decide(self, state: ScaleState, now_s: float, ongoing: float,
               bounds: ReplicaBounds) -> tuple[ScaleDecision, ScaleState, Figure]:
        """Desired replicas from ``ongoing`` requests, then stabilised: (decision, next state, arithmetic)."""
        desired = request_desired_replicas(ongoing, self.target_ongoing_requests)
        decision, nxt = stabilize(state, now_s, int(desired.value), bounds, self.stabilizer)
        return decision, nxt, desired
