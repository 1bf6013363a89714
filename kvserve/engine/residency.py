"""What the scheduler asks before a sequence may run, beside the KV blocks: that the
weights it needs are resident (a LoRA adapter in one of a fixed number of slots).

The scheduler tells the gate which adapter every sequence uses when it is queued
(``register``) and when it has ended (``forget``); it calls ``acquire`` when it would
admit a sequence and ``release`` when a sequence stops running (preempted). A gate
that refuses leaves the sequence at its place in the queue while later ones may go
ahead. ``OpenGate`` (no adapters) admits everyone. Pure Python, no torch.
"""
from __future__ import annotations

from typing import Protocol


class ResidencyGate(Protocol):
    """Admission by resident weights; implemented by ``kvserve.lora.manager.LoRAManager``."""

    def register(self, seq_id: int, adapter_key: str | None) -> None:
        """A queued sequence that will need ``adapter_key`` (None: the base weights)."""

    def acquire(self, seq_id: int) -> bool:
        """Pin what ``seq_id`` needs for as long as it runs; False: not now (it waits)."""

    def share(self, seq_id: int, leader_id: int) -> None:
        """A sibling forked from a running leader pins what the leader pins (never refused:
        the leader holds it resident)."""

    def release(self, seq_id: int) -> None:
        """It stopped running (preempted): unpin; a no-op if nothing was pinned."""

    def forget(self, seq_id: int) -> None:
        """It ended (finished, aborted, or never ran): unpin and drop it; idempotent."""


class OpenGate:
    """Every sequence may run: the engine serves base weights only."""

    def register(self, seq_id: int, adapter_key: str | None) -> None:
        return None

    def acquire(self, seq_id: int) -> bool:
        return True

    def share(self, seq_id: int, leader_id: int) -> None:
        return None

    def release(self, seq_id: int) -> None:
        return None

    def forget(self, seq_id: int) -> None:
        return None
