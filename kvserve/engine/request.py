"""The one request type: what the front end (offline ``LLM`` or the HTTP process) asks
the engine to generate, carried unchanged to the scheduler and used as the IPC message.

A new per-request option (adapter, priority class, deadline, quantised variant...) is
one field here; every layer passes the whole request on.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass

from kvserve.engine.service_class import ServiceClass
from kvserve.engine.structured_spec import StructuredSpec
from kvserve.sampling.params import SamplingParams


@dataclass(frozen=True)
class EngineRequest:
    """One generation request (``params.n`` sequences share its prompt).

    - ``eos_token_ids``: tokens that end a sequence; None = the model's own.
    - ``priority``: lower runs first; FCFS within a value.
    - ``tenant``: who sent it (the API key's tenant), for accounting.
    - ``cache_salt`` / ``adapter_id``: the prefix-cache namespace (with the engine's
      weight epoch). The salt must be derived from the authenticated caller, never
      copied from a request body, so tenants never share KV blocks.
    - ``use_prefix_cache``: False = neither read nor fill the prefix cache.
    - ``prefix_cache_grace_s``: how long this request's blocks stay unevictable after it
      finishes (a conversation turn whose next message is expected); None = the engine's.
    - ``num_speculative_tokens``: most lookahead (draft) tokens per step; None = the
      engine's setting, 0 = never speculate; ignored when speculation is off.
    - ``service_class``: the latency class (``engine/service_class.py``: interactive,
      chat, batch); the scheduling policy reads it, the tokens never depend on it.
    - ``structured``: a constraint every sequence's output must match (JSON schema,
      regex, choice, grammar); None = unconstrained.
    """

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    eos_token_ids: frozenset[int] | None = None
    priority: int = 0
    tenant: str | None = None
    cache_salt: str | None = None
    adapter_id: str | None = None
    use_prefix_cache: bool = True
    prefix_cache_grace_s: float | None = None
    num_speculative_tokens: int | None = None
    service_class: ServiceClass = ServiceClass.CHAT
    structured: StructuredSpec | None = None


class RequestStatus(str, enum.Enum):
    """Where a request stands in the engine (``EngineCore.request_status``)."""

    WAITING = "waiting"       # queued: nothing computed yet (new, or every sequence preempted)
    RUNNING = "running"       # at least one sequence holds KV or has produced tokens
