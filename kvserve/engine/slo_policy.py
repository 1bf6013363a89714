"""The SLO scheduling policy: request classes (``engine/service_class.py``) with TTFT and
TPOT targets.

- Order: class rank (interactive, chat, batch), then priority, then arrival. Running
  interactive sequences are served first and preempted last; batch first.
- Next step: waiting sequences of a higher class are admitted before running ones of a
  lower class take their tokens, so an interactive request enters the very next step;
  when KV blocks are short, admitting it preempts a lower-class sequence.
- Budget: while a class that shapes the budget (interactive by default) has decoding
  or waiting sequences, the step's token budget is the most tokens whose predicted step time
  (``a + b * tokens``, fitted to measured steps) stays within that class's TPOT target —
  never less than its own tokens, ``min_step_tokens``, or ``a / b`` (the size at which a
  step costs twice its fixed part: smaller steps would starve chat and batch for a
  target the machine cannot reach). Chat and batch fill the rest.
- Batching window: a new batch-class request waits up to ``batch_window_s`` so that more
  arrive and share a step; it is released early once the waiting batch requests would
  fill the step's budget or the free sequence slots. Interactive and chat never wait.
- No starvation: a sequence left out of ``max_passed_over_steps`` steps in which a higher
  class ran (counted since it last ran) is served as if interactive until it runs, so every
  class progresses at a bounded rate. Steps that only ran its own or lower classes do not
  count: waiting behind its own class (full slots, a flood) is not starvation, and aging
  there would let a backlog outrank the next interactive request and undo the fair-share
  order within the class.
- Keystrokes: an aborted interactive request keeps its cached blocks protected for the
  grace a finished one gets (the next keystroke's prompt extends it).
"""
from __future__ import annotations

from dataclasses import dataclass, field

from kvserve.engine.sequence import Sequence
from kvserve.engine.service_class import ServiceClass
from kvserve.engine.step_time import LinearTimeModel


@dataclass(frozen=True)
class ClassTargets:
    """One class's latency targets (seconds). ``shapes_budget``: its decodes' TPOT target
    limits the step's token budget."""

    ttft_s: float
    tpot_s: float
    shapes_budget: bool = False


DEFAULT_TARGETS: dict[ServiceClass, ClassTargets] = {
    ServiceClass.INTERACTIVE: ClassTargets(ttft_s=0.15, tpot_s=0.05, shapes_budget=True),
    ServiceClass.CHAT: ClassTargets(ttft_s=1.0, tpot_s=0.2),
    ServiceClass.BATCH: ClassTargets(ttft_s=30.0, tpot_s=2.0),
}


@dataclass(frozen=True)
class SloPolicySettings:
    """Resolved settings of ``SloPolicy`` (``EngineConfig``: ``class_targets``,
    ``batch_window_s``, ``max_passed_over_steps``, ``min_step_tokens``)."""

    targets: dict[ServiceClass, ClassTargets] = field(default_factory=lambda: dict(DEFAULT_TARGETS))
    batch_window_s: float = 0.0
    max_passed_over_steps: int = 32
    min_step_tokens: int = 32


class SloPolicy:
    """Request classes with TTFT/TPOT targets (see the module docstring)."""

    num_group_keys = 2                    # (rank, priority, arrival, sibling)

    def __init__(self, settings: SloPolicySettings | None = None, step_time: LinearTimeModel | None = None):
        """``step_time``: the engine's measured step-time model (it observes every step)."""
        self.settings = settings or SloPolicySettings()
        self.step_time = step_time or LinearTimeModel()
        self._batch_released = True
        self._oldest_held: float | None = None
        self._candidates: list[Sequence] = []    # this step's running and waiting sequences

    # ------------------------------------------------------------------ order
    def rank(self, seq: Sequence) -> int:
        """The class rank the sequence is served at now (0 once passed over too long)."""
        if seq.num_steps_passed_over >= self.settings.max_passed_over_steps:
            return 0
        return seq.service_class.rank

    def sort_key(self, seq: Sequence) -> tuple:
        return (self.rank(seq), *seq.sort_key)

    # ------------------------------------------------------------------- step
    def begin_step(self, running, waiting, max_num_batched_tokens: int, free_seq_slots: int,
                   now: float) -> int:
        self._candidates = [*running, *waiting]
        budget = self._budget(running, waiting, max_num_batched_tokens)
        self._decide_window(waiting, budget, free_seq_slots, now)
        return budget

    def _budget(self, running, waiting, max_tokens: int) -> int:
        """The TPOT-shaped budget while a shaping class has decoding sequences or waiting
        ones (their first token comes out of this step too)."""
        shaping = [s for s in running if self._shapes(s) and s.output_token_ids]
        shaping += [s for s in waiting if self._shapes(s)]
        if not shaping:
            return max_tokens
        tpot_s = min(self.settings.targets[s.service_class].tpot_s for s in shaping)
        fit = self.step_time.coefficients()
        if fit is None or fit[1] <= 0.0:
            return max_tokens
        fixed_s, per_token_s = fit
        within_tpot = max(int((tpot_s - fixed_s) / per_token_s), 0)
        # Below fixed/per-token tokens a step is mostly fixed cost (it runs at under half its
        # per-token efficiency): when the target is out of reach, a step may still take up
        # to twice its fixed cost rather than starve the other classes.
        half_efficiency = round(fixed_s / per_token_s)
        own = sum(min(s.num_tokens_to_compute, max_tokens)
                  for s in (*running, *waiting) if self._shapes(s))
        return min(max_tokens, max(within_tpot, half_efficiency, own, self.settings.min_step_tokens))

    def _shapes(self, seq: Sequence) -> bool:
        targets = self.settings.targets.get(seq.service_class)
        return targets is not None and targets.shapes_budget

    def admit_before(self, waiting: Sequence, running: Sequence) -> bool:
        return self.rank(waiting) < self.rank(running)

    # ---------------------------------------------------------- batching window
    def _decide_window(self, waiting, budget: int, free_seq_slots: int, now: float) -> None:
        window = self.settings.batch_window_s
        held = [s for s in waiting if self._windowed(s)]
        if window <= 0.0 or not held:
            self._batch_released, self._oldest_held = True, None
            return
        oldest = min(s.arrival_time for s in held)
        tokens = sum(s.num_tokens_to_compute for s in held)
        self._batch_released = (now - oldest >= window or tokens >= budget or len(held) >= free_seq_slots)
        self._oldest_held = None if self._batch_released else oldest

    @staticmethod
    def _windowed(seq: Sequence) -> bool:
        """A batch request that has not run yet (a preempted one is never held again)."""
        return (seq.service_class is ServiceClass.BATCH and seq.num_preemptions == 0
                and not seq.output_token_ids)

    def holds_back(self, seq: Sequence) -> bool:
        return not self._batch_released and self._windowed(seq)

    def wake_in_s(self, now: float) -> float | None:
        if self._oldest_held is None:
            return None
        return max(self.settings.batch_window_s - (now - self._oldest_held), 0.0)

    # ------------------------------------------------------------ preemption
    def may_preempt_for(self, seq: Sequence, victim: Sequence) -> bool:
        return self.rank(victim) > seq.service_class.rank      # an aged victim is safe

    def abort_grace_s(self, seq: Sequence, grace_s: float) -> float:
        return grace_s if seq.service_class is ServiceClass.INTERACTIVE else 0.0

    def end_step(self, scheduled: list[tuple[Sequence, int]]) -> None:
        """The starvation guard's count: a sequence this step left out while a higher class
        ran is passed over once more; a scheduled one starts again from 0."""
        ran = {seq.seq_id for seq, _n in scheduled}
        best_rank = min((seq.service_class.rank for seq, _n in scheduled), default=None)
        for seq in self._candidates:
            if seq.seq_id in ran:
                seq.num_steps_passed_over = 0
            elif best_rank is not None and best_rank < seq.service_class.rank and not seq.is_finished:
                seq.num_steps_passed_over += 1
        self._candidates = []
