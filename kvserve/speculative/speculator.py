"""The one speculator: reserves lookahead slots, has the proposer fill them, hands the
verifier this step's draft distributions, and learns from what was accepted.

It plugs into the engine's step through ``kvserve.engine.lookahead``'s interface::

    extend(plan, scheduler): controller picks k per decoding sequence
                             -> scheduler.reserve_lookahead (budget, blocks; never preempts)
                             -> proposer.propose -> lookahead_token_ids, draft probs
    observe(plan, result, updates): step time, draft-pass times, acceptance -> controller;
                             proposer rolls its state forward; ended sequences forgotten
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from kvserve.engine.stats import SpeculationCounters
from kvserve.engine.step import SeqUpdate, StepPlan, StepResult
from kvserve.speculative.controller import SpecController
from kvserve.speculative.proposer import Proposer

if TYPE_CHECKING:                    # the verifier is torch; this module stays importable without it
    from kvserve.speculative.verify import Verifier


class Speculator:
    """Speculative decoding for one engine: a proposer, the adaptive controller and the
    verifier the runner calls."""

    def __init__(self, proposer: Proposer, controller: SpecController, verifier: Verifier):
        self.proposer = proposer
        self.controller = controller
        self.verifier = verifier

    def extend(self, plan: StepPlan, scheduler) -> None:
        """Reserve lookahead slots for the sequences the controller picks and fill them."""
        candidates = [(s.seq_id, s.lookahead_limit) for s in plan.scheduled if s.lookahead_limit > 0]
        if candidates:
            items = {s.seq_id: s for s in plan.scheduled}
            for seq_id, k in self.controller.plan(candidates, plan.num_tokens).items():
                scheduler.reserve_lookahead(plan, items[seq_id], k)
        drafts = self.proposer.propose(plan)
        for item in plan.scheduled:
            draft = drafts.get(item.seq_id)
            if draft is not None:
                item.lookahead_token_ids = list(draft.token_ids)
        self.verifier.set_draft_probs({sid: d.probs for sid, d in drafts.items() if d.probs is not None})

    def observe(self, plan: StepPlan, result: StepResult, updates: list[SeqUpdate]) -> None:
        """Feed step times and verification outcomes to the controller; let the proposer
        roll its state forward; forget sequences that ended or were preempted."""
        controller = self.controller              # step times: the engine feeds the shared model
        for num_seqs, seconds in self.proposer.pass_times:
            controller.observe_draft_pass(num_seqs, seconds)
        for u in updates:
            if u.num_draft_proposed:
                controller.observe_verification(u.seq_id, u.num_draft_proposed, u.num_draft_accepted)
        accepted = {seq_id: len(tokens) for seq_id, tokens in result.accepted_lookahead.items()}
        finished = [u.seq_id for u in updates if u.finish_reason is not None]
        self.proposer.on_step_done(plan, accepted, finished)
        self.forget(finished + plan.preempted_seq_ids)

    def forget(self, seq_ids: list[int]) -> None:
        """Drop speculation state of sequences that ended or restart from scratch."""
        if seq_ids:
            self.proposer.forget(seq_ids)
            for seq_id in seq_ids:
                self.controller.forget(seq_id)

    def counters(self) -> SpeculationCounters:
        s = self.controller.stats
        return SpeculationCounters(True, s.num_proposed, s.num_accepted, s.num_verifications, s.num_steps_on,
                                   s.num_steps_off, list(s.accepted_per_position))

    def stats(self) -> dict:
        """Proposed, accepted, per position, alpha, mean accepted length, steps on/off."""
        return self.controller.stats.as_dict()


def build_speculator(spec, ctx, verifier: Verifier, step_time=None) -> Speculator:
    """The speculator for a SpeculativeConfig: its proposer from the registry, a controller
    with the config's knobs reading the engine's step-time model ``step_time``, and the
    verifier the runner was given."""
    from kvserve.speculative.registry import proposer_entry

    proposer = proposer_entry(spec.method).build(ctx)
    controller = SpecController(spec.num_speculative_tokens, spec.min_gain, spec.max_batch_size,
                                uses_draft_model=proposer.uses_model, adaptive=spec.adaptive,
                                forward_time=step_time)
    return Speculator(proposer, controller, verifier)
