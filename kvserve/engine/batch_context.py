"""Per-forward metadata for transforms on the model's projections (LoRA segments).

The runner asks its ``BatchContext`` for the order of a step's sequences (sequences that
use the same adapter side by side, so a transform computes one product per run of
rows, never per token), then brackets its forward with ``begin`` / ``end``. Outside a
bracket (a draft model's forward) transforms act as if nothing were set. The context
is an object the runner owns and the transforms were built with: no module global.
"""
from __future__ import annotations

from typing import Protocol, Sequence

from kvserve.engine.step import ScheduledSeq


class BatchContext(Protocol):
    def order(self, items: Sequence[ScheduledSeq]) -> list[ScheduledSeq]:
        """The sequences in the order their rows are laid out in the forward."""

    def begin(self, items: Sequence[ScheduledSeq], num_rows: Sequence[int]) -> None:
        """Set the metadata of one forward: ``items`` in row order, ``num_rows[i]`` rows each."""

    def end(self) -> None:
        """The forward is over: transforms see no metadata until the next ``begin``."""


class PlainBatch:
    """No transform needs metadata: plan order, nothing to set."""

    def order(self, items: Sequence[ScheduledSeq]) -> list[ScheduledSeq]:
        return list(items)

    def begin(self, items: Sequence[ScheduledSeq], num_rows: Sequence[int]) -> None:
        return None

    def end(self) -> None:
        return None
