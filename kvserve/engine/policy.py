"""Scheduling policies: the order, the per-step token budget and the waiting rules the
scheduler consults. The scheduler turns "who runs, how many tokens" into a plan; a
policy only answers questions about sequences and never touches blocks or plans.

One step asks, in this order::

    budget = policy.begin_step(running, waiting, max_num_batched_tokens, free_seq_slots, now)
    running in policy.sort_key order:  n = min(to compute, budget left); but first, waiting
                                       sequences with policy.admit_before(them, seq) are admitted
    waiting in policy.sort_key order:  skipped while policy.holds_back(seq);
                                       may preempt a running seq if policy.may_preempt_for(seq, it)

Victims of preemption are taken from the end of the running order. ``FcfsPolicy`` is
priority then arrival order with the whole budget every step; ``SloPolicy``
(``engine/slo_policy.py``) adds request classes.
"""
from __future__ import annotations

from typing import Protocol, Sequence as Seq

from kvserve.engine.sequence import Sequence


class SchedulingPolicy(Protocol):
    """What the scheduler asks each step (plain numbers and sequences, no tensors)."""

    #: How many leading elements of ``sort_key`` form the policy's groups (classes,
    #: priorities): a wrapping policy orders within them, before the rest (arrival).
    num_group_keys: int

    def sort_key(self, seq: Sequence) -> tuple:
        """Order among running sequences (served first, preempted last) and among
        waiting ones (admitted first). Must be unique per sequence."""

    def begin_step(self, running: Seq[Sequence], waiting: Seq[Sequence], max_num_batched_tokens: int,
                   free_seq_slots: int, now: float) -> int:
        """Start a step: the step's token budget (1..max_num_batched_tokens); the
        answers of the calls below hold for this step."""

    def admit_before(self, waiting: Sequence, running: Sequence) -> bool:
        """True: the waiting sequence is admitted (if it fits) before the running one gets
        its tokens this step, so it does not wait for the budget that one would take."""

    def holds_back(self, seq: Sequence) -> bool:
        """True: the waiting ``seq`` is not admitted this step (it keeps its place)."""

    def may_preempt_for(self, seq: Sequence, victim: Sequence) -> bool:
        """True: admitting the waiting ``seq`` may preempt the running ``victim`` when
        KV blocks are short (recompute; the victim returns to the waiting queue)."""

    def abort_grace_s(self, seq: Sequence, grace_s: float) -> float:
        """Seconds an aborted ``seq``'s cached blocks stay unevictable (``grace_s``: what
        a finished one would get)."""

    def wake_in_s(self, now: float) -> float | None:
        """When nothing is runnable because sequences are held back: seconds until one
        may be admitted (the engine waits that long for new messages); None otherwise."""

    def end_step(self, scheduled: list[tuple[Sequence, int]]) -> None:
        """The step's plan is made: each scheduled sequence and the tokens it computes
        (from its ``num_computed_tokens``; positions before the end of the prompt are
        input). Called once at the end of every ``schedule()``."""


class FcfsPolicy:
    """First come, first served within ``priority``; the whole budget every step;
    aborted requests' blocks get no grace."""

    num_group_keys = 1                    # (priority, arrival, sibling)

    def sort_key(self, seq: Sequence) -> tuple:
        return seq.sort_key

    def begin_step(self, running, waiting, max_num_batched_tokens: int, free_seq_slots: int,
                   now: float) -> int:
        return max_num_batched_tokens

    def admit_before(self, waiting: Sequence, running: Sequence) -> bool:
        return False

    def holds_back(self, seq: Sequence) -> bool:
        return False

    def may_preempt_for(self, seq: Sequence, victim: Sequence) -> bool:
        return False

    def abort_grace_s(self, seq: Sequence, grace_s: float) -> float:
        return 0.0

    def wake_in_s(self, now: float) -> float | None:
        return None

    def end_step(self, scheduled: list[tuple[Sequence, int]]) -> None:
        pass
