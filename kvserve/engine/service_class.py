"""Request classes: who can afford to wait.

A request's class says what latency it needs, not how important its sender is:

- ``interactive``: inline completions (ghost text) — enter the next step, never wait for a
  batching window, their decodes keep a TPOT target, preempted last;
- ``chat``: conversational turns — the default;
- ``batch``: bulk jobs — may wait a batching window to widen a step, preempted first.

OpenAI's ``service_tier`` names them on the wire: ``priority`` -> interactive,
``default`` / ``auto`` -> chat, ``flex`` -> batch. The scheduler never reads the names;
a ``SchedulingPolicy`` does.
"""
from __future__ import annotations

import enum


class ServiceClass(str, enum.Enum):
    """A request's latency class; the value is its wire name in kvserve's own fields."""

    INTERACTIVE = "interactive"
    CHAT = "chat"
    BATCH = "batch"

    @property
    def rank(self) -> int:
        """Scheduling rank: lower is served first and preempted last."""
        return _RANKS[self]


_RANKS = {ServiceClass.INTERACTIVE: 0, ServiceClass.CHAT: 1, ServiceClass.BATCH: 2}

# OpenAI's service_tier values -> classes
SERVICE_TIERS: dict[str, ServiceClass] = {
    "priority": ServiceClass.INTERACTIVE,
    "default": ServiceClass.CHAT,
    "auto": ServiceClass.CHAT,
    "flex": ServiceClass.BATCH,
}


def class_for_tier(tier: str) -> ServiceClass:
    """The class an OpenAI ``service_tier`` value names (KeyError for an unknown tier)."""
    return SERVICE_TIERS[tier]


def parse_class(name: str) -> ServiceClass:
    """A class by its own name (``interactive``/``chat``/``batch``) or by a service tier;
    ValueError naming the accepted values otherwise."""
    if name in SERVICE_TIERS:
        return SERVICE_TIERS[name]
    try:
        return ServiceClass(name)
    except ValueError:
        accepted = sorted({c.value for c in ServiceClass} | set(SERVICE_TIERS))
        raise ValueError(f"unknown service class {name!r}; expected one of {', '.join(accepted)}") from None
