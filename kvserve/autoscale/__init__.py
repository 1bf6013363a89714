"""Autoscaling as pure policy functions (docs/autoscaling.md).

Token-based: desired replicas = ceil((prefill tokens/s / prefill capacity + decode tokens/s /
decode capacity) x headroom), capacities at the SLO from the planner; request-count baseline:
ceil(ongoing / target_ongoing_requests). Both scale up at once and down after a stabilisation
window, one step at a time, within the residency tier's bounds (hot >= 1; warm, cold >= 0).
No clocks, no globals, no torch, no Ray: the Ray Serve hook and the fleet simulator call these.
"""
from kvserve.autoscale.capacity import ReplicaCapacity, capacity_from_candidate, replica_capacity
from kvserve.autoscale.errors import AutoscaleInputError
from kvserve.autoscale.policy import (RequestCountPolicy, TokenPolicy, request_desired_replicas,
                                      token_desired_replicas)
from kvserve.autoscale.signals import FleetScrape, ReplicaCounters, TokenDemand, ongoing_requests, token_demand
from kvserve.autoscale.stabilize import ScaleDecision, ScaleState, StabilizerConfig, stabilize
from kvserve.autoscale.tiers import ReplicaBounds, ResidencyTier, bounds_for_tier

__all__ = [
    "AutoscaleInputError", "FleetScrape", "ReplicaBounds", "ReplicaCapacity", "ReplicaCounters",
    "RequestCountPolicy", "ResidencyTier", "ScaleDecision", "ScaleState", "StabilizerConfig", "TokenDemand",
    "TokenPolicy", "bounds_for_tier", "capacity_from_candidate", "ongoing_requests", "replica_capacity",
    "request_desired_replicas", "stabilize", "token_demand", "token_desired_replicas",
]
