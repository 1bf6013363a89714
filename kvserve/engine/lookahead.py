"""The seam for lookahead (speculative) tokens: what the engine needs from a speculator
and a verifier, without knowing how drafts are made. Implementations live in
``kvserve.speculative``; ``NullSpeculator`` is the engine's default (speculation off).

One step reads ``schedule -> extend -> execute -> update -> observe``:

- ``Speculator.extend(plan, scheduler)``: reserve lookahead slots through
  ``scheduler.reserve_lookahead`` and fill ``lookahead_token_ids`` in the plan;
- the runner computes each lookahead token in the same forward pass and hands its
  sampling rows to the injected ``Verifier``, which decides how many are accepted;
- ``Speculator.observe(plan, result, updates)``: learn from the outcome.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from kvserve.engine.stats import SpeculationCounters
from kvserve.engine.step import SampledToken, SeqUpdate, StepPlan, StepResult


@dataclass(frozen=True)
class LookaheadGroup:
    """One sequence's verification rows: ``first_row`` samples the token after its last
    real token, row ``first_row + j + 1`` the token after lookahead token ``j``."""

    seq_id: int
    first_row: int
    token_ids: list[int]


class Verifier(Protocol):
    def __call__(self, logits, rows: list, groups: list[LookaheadGroup]
                 ) -> tuple[list[SampledToken], dict[int, list[SampledToken]], dict[int, SampledToken]]:
        """Sample every row (``logits`` ``[rows, vocab]``, one SamplingRow each) and settle
        each group: ``(per-row samples, accepted lookahead tokens by seq id, the token
        that follows them by seq id)``."""


class Speculator(Protocol):
    def extend(self, plan: StepPlan, scheduler) -> None:
        """Add lookahead tokens to a plan (after ``schedule``, before ``execute``)."""

    def observe(self, plan: StepPlan, result: StepResult, updates: list[SeqUpdate]) -> None:
        """Learn from a step's outcome (after ``update``)."""

    def forget(self, seq_ids: list[int]) -> None:
        """Drop state of sequences that ended or restart from scratch."""

    def counters(self) -> SpeculationCounters:
        """Counters since start."""

    def stats(self) -> dict | None:
        """The full counters as a dict, or None when off."""


class NullSpeculator:
    """Speculation off: plans are never extended."""

    def extend(self, plan: StepPlan, scheduler) -> None:
        return None

    def observe(self, plan: StepPlan, result: StepResult, updates: list[SeqUpdate]) -> None:
        return None

    def forget(self, seq_ids: list[int]) -> None:
        return None

    def counters(self) -> SpeculationCounters:
        return SpeculationCounters()

    def stats(self) -> dict | None:
        return None
