"""What a router knows: each replica's load and health, and the request to place."""
from __future__ import annotations

from dataclasses import dataclass, field

from kvserve.engine.kv.cache_events import CacheNamespace


@dataclass
class ReplicaState:
    """One replica as the router last heard of it (its engine's stats and health).

    ``kv_usage``: fraction of its KV blocks held by running sequences; ``queued_tokens``:
    prompt tokens of its waiting requests past the prefix its cache held when each was sent
    (``EngineClient._uncached_tokens``: the work still to do, not the prompt's length); ``max_num_seqs``: its decode slots (0: unknown); ``healthy``: False while
    it reports an unhealthy engine; ``breaker_open``: True while the runtime's circuit
    breaker for it is not closed (it failed requests; back once a probe succeeds). A replica
    that is unhealthy or whose breaker is open is never chosen (``routable``)."""

    name: str
    num_running: int = 0
    num_waiting: int = 0
    kv_usage: float = 0.0
    max_num_seqs: int = 0
    queued_tokens: int = 0
    resident_adapters: frozenset[str] = field(default_factory=frozenset)   # identities in its LoRA slots
    healthy: bool = True
    breaker_open: bool = False

    @property
    def routable(self) -> bool:
        """Whether a policy may choose it: healthy and its breaker closed."""
        return self.healthy and not self.breaker_open

    @property
    def load(self) -> float:
        """Requests it holds per decode slot (1.0: every slot busy; above: a queue)."""
        return (self.num_running + self.num_waiting) / max(1, self.max_num_seqs)


def adapter_identity(model: str | None, adapter_ids: dict[str, str]) -> str | None:
    """The identity (the engine's key: the files' digest) of the LoRA adapter a request's
    ``model`` names, from the replicas' loaded adapters ``{name: id}``, as the server selects
    it (the name, or ``<base>:<name>``); None for the base model or a name no replica holds."""
    if not model:
        return None
    if model in adapter_ids:
        return adapter_ids[model]
    for i, char in enumerate(model):
        if char == ":" and model[i + 1:] in adapter_ids:
            return adapter_ids[model[i + 1:]]
    return None


@dataclass(frozen=True)
class RouteRequest:
    """A request to place: its prompt tokens (as the engine will see them), the cache
    namespace the server derives for it (adapter, weight epoch, tenant salt) and an
    optional session key (OpenAI's ``prompt_cache_key``)."""

    token_ids: tuple[int, ...]
    namespace: CacheNamespace = CacheNamespace()
    session_key: str | None = None


@dataclass(frozen=True)
class Decision:
    """Where a request goes and why: ``reason`` is one of ``round_robin``,
    ``least_loaded``, ``prefix`` (it holds more of the prompt than some other replica),
    ``session`` (its session's replica), ``spread`` (a tie, to the least used replica)
    (a runtime may add its own: the Ray router's ``pinned`` and ``fallback``);
    ``matched_blocks`` of the request's ``num_blocks`` full blocks (``cached_tokens``
    prompt tokens) are cached there as far as the router knows."""

    replica: str
    policy: str
    reason: str
    matched_blocks: int = 0
    num_blocks: int = 0
    cached_tokens: int = 0
