"""One step's LoRA segments: which runs of rows use which resident slot.

``order`` lays a step's sequences out by slot (base-weight sequences first), so that
all rows of one adapter are contiguous; ``begin`` turns that layout into segments
``(first_row, end_row, slot)``. Every ``LoRALinear`` reads the same segments, so the
delta of a step with rows of 16 adapters is 16 pairs of small products per projection
(Punica's SGMV, as plain matrix products on row slices): no per-token weight gather,
and base rows cost nothing. Outside a ``begin`` / ``end`` bracket (a draft model's
forward over shared layers) there are no segments and projections are the base.
"""
from __future__ import annotations

from typing import Callable, Sequence

import torch

from kvserve.engine.step import ScheduledSeq


class LoRABatch:
    """The ``BatchContext`` of a model whose projections are ``LoRALinear``."""

    def __init__(self, slot_of: Callable[[str], int]):
        self.slot_of = slot_of                   # resident slot of an adapter key
        self.segments: list[tuple[int, int, int]] = []

    def _slot(self, item: ScheduledSeq) -> int:
        return -1 if item.adapter_key is None else self.slot_of(item.adapter_key)

    def order(self, items: Sequence[ScheduledSeq]) -> list[ScheduledSeq]:
        return sorted(items, key=self._slot)     # stable: plan order within a slot

    def begin(self, items: Sequence[ScheduledSeq], num_rows: Sequence[int]) -> None:
        segments, row = [], 0
        for item, n in zip(items, num_rows):
            slot = self._slot(item)
            if slot >= 0:
                if segments and segments[-1][2] == slot and segments[-1][1] == row:
                    segments[-1] = (segments[-1][0], row + n, slot)
                else:
                    segments.append((row, row + n, slot))
            row += n
        self.segments = segments

    def end(self) -> None:
        self.segments = []

    def add_delta_(self, out: torch.Tensor, x: torch.Tensor, views: list) -> torch.Tensor:
        """``out[rows] += (x[rows] @ A) @ B`` for every segment whose slot adapts this
        projection; ``views[slot]`` is ``(A [in, w], B [w, out])`` or None."""
        for first, end, slot in self.segments:
            ab = views[slot]
            if ab is not None:
                out[first:end].addmm_(torch.mm(x[first:end], ab[0]), ab[1])
        return out
