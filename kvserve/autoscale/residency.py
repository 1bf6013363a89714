"""Residency tiers from measured popularity, with hysteresis, inside a host-cache budget.

Each model has a *planned* tier (``kvserve plan --fleet``: the cheapest layout, then promotions
to hot by cold-start waits avoided per dollar) and a measured load ``L`` in replica-equivalents
(its tokens/s over the last window divided by one replica's capacity at the SLO). The tier it
runs in now is::

    hot   if planned hot, or L >= promote_load, or (hot now and L >= demote_load)
    warm  otherwise, while its weights fit the host cache (models by L, highest first)
    cold  otherwise

``demote_load < promote_load`` is the hysteresis: a model that crossed ``promote_load`` stays
hot until its load falls below ``demote_load``, so a load hovering at the threshold does not flap.
A pure function: the measured loads are passed in; nothing here reads a clock.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

from kvserve.autoscale.errors import AutoscaleInputError
from kvserve.autoscale.tiers import ResidencyTier


@dataclass(frozen=True)
class RetierConfig:
    """Thresholds in replica-equivalents of measured load, and the host cache's bytes."""

    promote_load: float = 0.5
    demote_load: float = 0.25
    host_cache_bytes: float = 256 * 2**30

    def __post_init__(self) -> None:
        if not 0 <= self.demote_load <= self.promote_load:
            raise AutoscaleInputError("need 0 <= demote_load <= promote_load", param="demote_load")


def retier(current: Mapping[str, ResidencyTier], planned: Mapping[str, ResidencyTier],
           load: Mapping[str, float], weight_bytes: Mapping[str, float],
           config: RetierConfig = RetierConfig()) -> dict[str, ResidencyTier]:
    """Each model's tier now (the module docstring's rule)."""
    tiers: dict[str, ResidencyTier] = {}
    for name, plan in planned.items():
        measured = load.get(name, 0.0)
        stays = current.get(name) is ResidencyTier.HOT and measured >= config.demote_load
        if plan is ResidencyTier.HOT or measured >= config.promote_load or stays:
            tiers[name] = ResidencyTier.HOT
    cache_left = config.host_cache_bytes
    for name in sorted((n for n in planned if n not in tiers), key=lambda n: (-load.get(n, 0.0), n)):
        if weight_bytes[name] <= cache_left:
            tiers[name], cache_left = ResidencyTier.WARM, cache_left - weight_bytes[name]
        else:
            tiers[name] = ResidencyTier.COLD
    return tiers
