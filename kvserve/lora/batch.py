"""One step's LoRA segments: which runs of rows use which resident slot.

``order`` lays a step's sequences out by slot (base-weight sequences first), so that
all rows of one adapter are contiguous; ``begin`` turns that layout into segments
``(first_row, end_row, slot)`` and plans how every ``LoRALinear`` adds their deltas:

- a long segment (a prefill chunk): ``out[rows] += (x[rows] @ A) @ B``, two products on
  a row slice (Punica's SGMV as plain matrix products);
- short segments (decodes, lookahead chunks) of consecutive slots: one batched product
  over that range of slots, the rows padded to the longest segment
  (``x -> [slots, L, in] @ A[range] @ B[range]``), so 16 adapters' decode rows cost a
  handful of operations per projection, not 32.

No weight is ever gathered (the stacks are sliced, not indexed) and base rows cost
nothing. Outside a ``begin`` / ``end`` bracket (a draft model's forward over shared
layers) there is no plan and projections are the base.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from kvserve.engine.step import ScheduledSeq
from kvserve.lora.slots import LayerSlots

SHORT_SEGMENT_ROWS = 8          # segments up to this long share one batched product per slot range
MAX_IDLE_SLOTS = 2              # a range of slots may include this many idle slots between two used ones


@dataclass(frozen=True)
class SlotRun:
    """Short segments of the slots ``first_slot .. first_slot + num_slots - 1``, their rows
    padded to ``rows_per_slot`` (an idle slot of the range gets zero rows: no delta)."""

    first_slot: int
    num_slots: int
    rows_per_slot: int
    rows: torch.Tensor              # rows of x, in segment order
    padded: torch.Tensor | None     # each row's place in [num_slots * rows_per_slot]; None: no padding
    first_row: int                  # with padded None: the rows are first_row .. in order


class LoRABatch:
    """The ``BatchContext`` of a model whose projections are ``LoRALinear``."""

    def __init__(self, slot_of: Callable[[str], int], device=None):
        self.slot_of = slot_of                   # resident slot of an adapter key
        self.device = device
        self.segments: list[tuple[int, int, int]] = []
        self.long_segments: list[tuple[int, int, int]] = []
        self.runs: list[SlotRun] = []

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
        short = [s for s in segments if s[1] - s[0] <= SHORT_SEGMENT_ROWS]
        groups = _consecutive_slots(short)
        self.runs = [self._run(g) for g in groups if len(g) > 1]
        self.long_segments = [s for s in segments if s[1] - s[0] > SHORT_SEGMENT_ROWS]
        self.long_segments += [g[0] for g in groups if len(g) == 1]

    def _run(self, group: list[tuple[int, int, int]]) -> SlotRun:
        first_slot, num_slots = group[0][2], group[-1][2] - group[0][2] + 1
        longest = max(end - first for first, end, _slot in group)
        rows = [r for first, end, _slot in group for r in range(first, end)]
        dense = num_slots * longest == len(rows) and rows == list(range(rows[0], rows[0] + len(rows)))
        padded = None if dense else torch.tensor(
            [(slot - first_slot) * longest + j for first, end, slot in group for j in range(end - first)],
            device=self.device)
        return SlotRun(first_slot, num_slots, longest, torch.tensor(rows, device=self.device), padded, rows[0])

    def end(self) -> None:
        self.segments, self.long_segments, self.runs = [], [], []

    def add_delta_(self, out: torch.Tensor, x: torch.Tensor, slots: LayerSlots) -> torch.Tensor:
        """Add every segment's ``(x[rows] @ A) @ B`` to ``out[rows]`` (see the module docstring)."""
        for first, end, slot in self.long_segments:
            ab = slots.views[slot]
            if ab is not None:
                out[first:end].addmm_(torch.mm(x[first:end], ab[0]), ab[1])
        for run in self.runs:
            _add_run_(out, x, slots, run)
        return out


def _consecutive_slots(segments: list[tuple[int, int, int]]) -> list[list[tuple[int, int, int]]]:
    """Segments (sorted by slot) grouped into ranges of slots with at most
    ``MAX_IDLE_SLOTS`` idle slots between two used ones."""
    groups: list[list[tuple[int, int, int]]] = []
    for segment in segments:
        if groups and segment[2] - groups[-1][-1][2] <= MAX_IDLE_SLOTS + 1:
            groups[-1].append(segment)
        else:
            groups.append([segment])
    return groups


def _add_run_(out: torch.Tensor, x: torch.Tensor, slots: LayerSlots, run: SlotRun) -> None:
    lo, hi = run.first_slot, run.first_slot + run.num_slots
    width = max(slots.width[lo:hi])
    if width == 0:
        return                                   # no slot of the range adapts this projection
    count, in_dim = run.num_slots * run.rows_per_slot, x.shape[1]
    if run.padded is None:
        xs = x[run.first_row:run.first_row + count].reshape(run.num_slots, run.rows_per_slot, in_dim)
    else:
        xs = x.new_zeros(count, in_dim).index_copy_(0, run.padded, x.index_select(0, run.rows))
        xs = xs.view(run.num_slots, run.rows_per_slot, in_dim)
    delta = torch.bmm(torch.bmm(xs, slots.a[lo:hi, :, :width]), slots.b[lo:hi, :width])
    delta = delta.view(count, -1)
    if run.padded is None:
        out[run.first_row:run.first_row + count].add_(delta)
    else:
        out.index_add_(0, run.rows, delta.index_select(0, run.padded))
