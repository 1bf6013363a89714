"""Residency tiers and the replica bounds each one gives the autoscaler.

- ``hot``: at least ``hot_min_replicas`` (>= 1) replicas always run; never scaled to zero.
- ``warm``: the weights stay resident in host memory, no replica need run: min 0 (a new
  replica skips cold-start layer 2, storage -> host).
- ``cold``: the weights are on disk only: min 0, the model may scale to zero.

For the policy, warm and cold have the same bounds; they differ in what a start from zero
costs (``host_weights_resident``), which the cold-start and residency code uses.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass

from kvserve.autoscale.errors import AutoscaleInputError


class ResidencyTier(str, enum.Enum):
    """Where a model's weights live when no request is running: on a replica, in host memory, on disk."""

    HOT = "hot"
    WARM = "warm"
    COLD = "cold"


@dataclass(frozen=True)
class ReplicaBounds:
    """Hard limits on a model's replica count: ``min_replicas <= replicas <= max_replicas``."""

    min_replicas: int
    max_replicas: int
    tier: ResidencyTier | None = None
    host_weights_resident: bool = False   # warm: a start maps weights from host memory

    def __post_init__(self) -> None:
        if self.min_replicas < 0:
            raise AutoscaleInputError(f"min_replicas {self.min_replicas} is negative", param="min_replicas")
        if self.max_replicas < max(1, self.min_replicas):
            raise AutoscaleInputError(f"max_replicas {self.max_replicas} must be >= max(1, min_replicas "
                                      f"{self.min_replicas})", param="max_replicas")

    def clamp(self, replicas: int) -> int:
        """``min(max(replicas, min_replicas), max_replicas)``."""
        return min(max(replicas, self.min_replicas), self.max_replicas)


def bounds_for_tier(tier: ResidencyTier | str, max_replicas: int, hot_min_replicas: int = 1) -> ReplicaBounds:
    """The bounds of ``tier``: hot -> [hot_min_replicas (>= 1), max]; warm, cold -> [0, max]."""
    tier = ResidencyTier(tier)
    if tier is ResidencyTier.HOT:
        if hot_min_replicas < 1:
            raise AutoscaleInputError(f"a hot model keeps >= 1 replica; got hot_min_replicas {hot_min_replicas}",
                                      param="hot_min_replicas")
        return ReplicaBounds(hot_min_replicas, max_replicas, tier)
    return ReplicaBounds(0, max_replicas, tier, host_weights_resident=tier is ResidencyTier.WARM)
