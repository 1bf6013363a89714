"""``LoRARequest``: the offline API's way to run a prompt with an adapter (vLLM's shape)."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LoRARequest:
    """Run with the PEFT adapter folder ``path`` under ``name``. The engine loads it on
    first use; a later request naming a different ``path`` under the same name reloads."""

    name: str
    path: str
