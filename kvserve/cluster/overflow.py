"""Rung 4 of the degradation ladder, ``overflow_chat``: chat traffic beyond what the fleet
takes goes to a smaller fallback model (``kvserve cluster serve --fallback-model``), served
by its own ``EngineReplica`` deployment (``app.py``).

"Beyond what the fleet takes": the fleet decodes at most ``fleet_slots`` = replicas ×
``--max-num-seqs`` requests at once; a request sent while this ingress already has that many
generation requests in flight on the fleet would wait in a queue (Ray Serve's, then the
replica's) behind all of them. While the rung is engaged, such a chat-class request goes to
the fallback instead; every other request (interactive, batch, a chat request while a slot
is free, a request naming a LoRA adapter or another model) stays on the fleet. The fleet
thus keeps its slots full and the ladder keeps measuring it (overflowed requests are not
its outcomes), so the rung releases once the fleet's own chat TTFT is back under the SLO.
"""
from __future__ import annotations

import json
from dataclasses import dataclass

from kvserve.cluster.ladder import Degradation
from kvserve.engine.service_class import ServiceClass

SERVED_BY_HEADER = "x-kvserve-served-by"     # "fleet" or "fallback" on every forwarded answer


@dataclass(frozen=True)
class FallbackTarget:
    """The fallback deployment as the ingress needs it: ``model_name`` (the id forwarded
    bodies name), ``fleet_models`` (the ids that name the fleet's base model: only requests
    for it overflow) and ``fleet_slots`` (the fleet's decode slots)."""

    model_name: str
    fleet_models: frozenset[str]
    fleet_slots: int


def overflows(effects: Degradation, service_class: ServiceClass | None, model: object, fleet_in_flight: int,
              target: FallbackTarget | None) -> bool:
    """Whether this request goes to the fallback: a fallback is configured, the rung in force
    includes ``overflow_chat``, the request is chat-class and names the fleet's base model
    (or no model), and the fleet's slots are all taken by this ingress's requests."""
    names_fleet = model is None or (isinstance(model, str) and model in target.fleet_models) if target else False
    return (target is not None and effects.overflow_chat_to is not None and service_class is ServiceClass.CHAT
            and names_fleet and fleet_in_flight >= target.fleet_slots)


def for_fallback(body: bytes, target: FallbackTarget) -> bytes:
    """The body forwarded to the fallback: the same request naming the fallback's model."""
    values = json.loads(body)
    values["model"] = target.model_name
    return json.dumps(values).encode()


class InFlight:
    """Generation requests this ingress has sent to the fleet and not yet seen finish."""

    def __init__(self):
        self.count = 0

    def ticket(self):
        """Count one more request; returns the function that stops counting it (once, however
        often it is called: both the relay's end and the response's background call it)."""
        self.count += 1
        done = False

        def leave() -> None:
            nonlocal done
            if not done:
                done = True
                self.count -= 1
        return leave
