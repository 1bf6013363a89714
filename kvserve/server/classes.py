"""The HTTP side of request classes: which class a request runs in, and the OpenAI
``service_tier`` name a response reports for it.

A request asks with ``service_tier`` (``protocol.py``); an API key may pin its tenant to
a class (``auth.py``). The pin wins: a tenant cannot promote itself by asking.
"""
from __future__ import annotations

from kvserve.engine.service_class import ServiceClass

# the tier a response names for each class (``auto`` is only ever asked for, never reported)
RESPONSE_TIERS: dict[ServiceClass, str] = {
    ServiceClass.INTERACTIVE: "priority",
    ServiceClass.CHAT: "default",
    ServiceClass.BATCH: "flex",
}


def tier_for_class(service_class: ServiceClass) -> str:
    """The OpenAI ``service_tier`` value that names the class a request ran in."""
    return RESPONSE_TIERS[service_class]


def choose_class(pinned: ServiceClass | None, requested: ServiceClass | None) -> ServiceClass:
    """The class a request runs in: the key's pinned class, else the one it asked for, else chat."""
    if pinned is not None:
        return pinned
    if requested is not None:
        return requested
    return ServiceClass.CHAT
