"""The engine's side of adapters: names a request may select, resolved to the identity
of what is loaded under that name now, plus load / unload / list for the API.

Implemented by ``kvserve.lora.manager.LoRAManager`` (injected by the builder; None when
LoRA is off). The identity is a content digest of the adapter (its weights and
scaling), so the prefix cache never serves one adapter's KV to another that was loaded
later under the same name. Pure Python, no torch.
"""
from __future__ import annotations

from typing import Protocol

from kvserve.engine.stats import AdapterCounters


class AdapterCatalog(Protocol):
    def resolve(self, name: str) -> str:
        """The identity (cache namespace, residency key) of the adapter loaded as ``name``
        now; raises ``AdapterNotFoundError`` if none is."""

    def load(self, name: str, path: str) -> dict:
        """Load and check a PEFT folder as ``name`` (``AdapterLoadError`` naming what is
        wrong); returns its description (``describe``)."""

    def unload(self, name: str) -> None:
        """``name`` no longer resolves; sequences already running with it finish first."""

    def describe(self) -> list[dict]:
        """Every loaded adapter: name, path, identity, rank, target modules, tier."""

    def counters(self) -> AdapterCounters:
        """Tiers, loads, evictions, waits (``EngineStats.adapters``)."""
