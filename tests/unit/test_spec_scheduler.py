"""Tier 1: the scheduler with speculative draft slots, without a model (fake
controller, scripted proposals and verification outcomes): blocks reserved for drafts
and given back, integrity under rejections / aborts / preemption / the prefix cache,
``max_tokens``, the context and stop tokens."""
from __future__ import annotations

import random

import pytest

from kvserve.engine.sequence import FinishReason, Sequence, SeqStatus
from kvserve.engine.step import SampledToken, StepPlan, StepResult
from kvserve.speculative.proposer import Draft
from kvserve.speculative.speculator import Speculator
from tests.support.scheduler_harness import EOS, SchedulerHarness


class GrantK:
    """A controller that always grants ``k`` drafts (within each sequence's limit)."""

    def __init__(self, k: int):
        self.k = k
        self.calls: list[tuple[list[tuple[int, int]], int]] = []

    def plan(self, candidates, base_tokens):
        self.calls.append((list(candidates), base_tokens))
        return {sid: min(limit, self.k) for sid, limit in candidates if self.k > 0}


class ScriptedProposer:
    """Drafts from ``script(item) -> tokens`` (default: one 7 per slot)."""

    uses_model = False
    pass_times: list = []
    script = None

    def propose(self, plan):
        return {s.seq_id: Draft(list(self.script(s) if self.script else [7] * s.num_lookahead_slots))
                for s in plan.scheduled if s.num_lookahead_slots > 0}


class NoProbs:
    def set_draft_probs(self, probs):
        assert not probs


class SpecHarness(SchedulerHarness):
    """The shared harness plus the real Speculator with a fake controller, a scripted
    proposer and a scripted verifier.

    ``propose(item) -> drafts`` (default: one 7 per slot) and ``accept(item) -> count``
    (default: all) decide each speculating sequence's step; the final token is 7.
    After every step: block integrity, and every running sequence holds exactly the
    blocks of its computed tokens (no draft block outlives its step).
    """

    def __init__(self, num_blocks=64, block_size=4, max_num_seqs=8, budget=64, k=4, max_model_len=None,
                 prefix_cache=False):
        super().__init__(num_blocks, block_size, max_num_seqs, budget, prefix_cache=prefix_cache,
                         max_model_len=max_model_len)
        self.controller = GrantK(k)
        self.proposer = ScriptedProposer()
        self.speculator = Speculator(self.proposer, self.controller, NoProbs())

    def add(self, request_id, prompt_len=8, max_tokens=8, n=1, num_speculative_tokens=None, prompt=None, **kw):
        kw.setdefault("ignore_eos", False)
        tokens = list(prompt) if prompt is not None else prompt_len
        return super().add(request_id, tokens, max_tokens, n, request_kw={
            "num_speculative_tokens": num_speculative_tokens}, **kw)

    def schedule(self, propose=None) -> StepPlan:
        plan = self.sched.schedule()
        self.proposer.script = propose
        self.speculator.extend(plan, self.sched)
        bs = self.pool.block_size
        for s in plan.scheduled:
            if s.num_lookahead_slots:
                assert s.sample and s.num_tokens == 1, "drafts only for decoding sequences"
            # the real token and every draft slot land in blocks the sequence holds
            assert len(s.block_table) * bs >= s.context_len + s.num_lookahead_slots
            assert s.block_table == self.seq(s.seq_id).block_table
            assert len(s.lookahead_token_ids) <= s.num_lookahead_slots
        assert plan.num_tokens <= self.sched.config.max_num_batched_tokens
        self.plans.append(plan)
        return plan

    def finish_step(self, plan, accept=None, final=7):
        sampled, accepted = {}, {}
        for s in plan.scheduled:
            if not s.sample:
                continue
            count = accept(s) if accept else len(s.lookahead_token_ids)
            assert 0 <= count <= len(s.lookahead_token_ids)
            if s.lookahead_token_ids:
                accepted[s.seq_id] = [SampledToken(t) for t in s.lookahead_token_ids[:count]]
            sampled[s.seq_id] = SampledToken(final(s) if callable(final) else final)
        updates = self.sched.update(plan, StepResult(sampled, accepted))
        self.record(updates)
        for u in updates:
            assert u.num_draft_accepted <= u.num_draft_proposed
            assert len(u.new_token_ids) <= u.num_draft_accepted + 1
        self.check()
        return updates

    def step(self, propose=None, accept=None, final=7):
        return self.finish_step(self.schedule(propose), accept, final)

    def check(self, mid_step=False):
        """``mid_step``: between schedule and update, when draft slots are still reserved."""
        self.sched.check_integrity()
        for seq in self.seqs:
            if seq.status is SeqStatus.RUNNING:
                assert mid_step or len(seq.block_table) == self.pool.blocks_for_tokens(seq.num_computed_tokens), \
                    f"seq {seq.seq_id} holds {len(seq.block_table)} blocks for {seq.num_computed_tokens} tokens"
                assert seq.num_computed_tokens <= seq.num_tokens
                assert len(seq.output_token_ids) <= seq.max_tokens
            else:
                assert not seq.block_table

    def run(self, max_steps=1000, **kw):
        for _ in range(max_steps):
            if not self.sched.has_unfinished():
                assert self.pool.num_used_blocks == 0
                return
            self.step(**kw)
        raise AssertionError("did not finish")


def _decode_ready(h: SpecHarness, **add_kw) -> Sequence:
    seq = h.add("a", **add_kw)
    plan = h.schedule()
    assert plan.scheduled[0].num_lookahead_slots == 0            # a prefill chunk never speculates
    h.finish_step(plan)
    return seq


def test_draft_slots_reserved_with_blocks_then_released_on_rejection():
    h = SpecHarness(block_size=4, k=4)
    seq = _decode_ready(h, prompt_len=4, max_tokens=20)       # 4 prompt tokens computed, 1 output
    assert seq.num_computed_tokens == 4 and len(seq.block_table) == 1
    plan = h.schedule()
    item = plan.scheduled[0]
    # the real token at position 4 and drafts at 5..8: 9 positions, 3 blocks
    assert item.num_lookahead_slots == 4 and item.start_position == 4
    assert len(seq.block_table) == 3 and h.pool.num_used_blocks == 3
    h.finish_step(plan, accept=lambda s: 0)                  # every draft rejected
    assert seq.output_token_ids == [7, 7]
    assert seq.num_computed_tokens == 5
    assert len(seq.block_table) == 2 and h.pool.num_used_blocks == 2
    assert h.pool.num_free_blocks == h.pool.num_blocks - 2


def test_accepted_drafts_advance_computed_tokens():
    h = SpecHarness(block_size=4, k=3)
    seq = _decode_ready(h, prompt_len=4, max_tokens=20)
    updates = h.step(propose=lambda s: [11, 12, 13], accept=lambda s: 2, final=14)
    assert seq.output_token_ids == [7, 11, 12, 14]
    assert [u.new_token_ids for u in updates] == [[11, 12, 14]]
    assert (updates[0].num_draft_proposed, updates[0].num_draft_accepted) == (3, 2)
    assert seq.num_computed_tokens == seq.num_tokens - 1 == 7
    h.step(accept=lambda s: 3)                               # all accepted: 4 more tokens
    assert seq.num_computed_tokens == seq.num_tokens - 1 == 11 and len(seq.output_token_ids) == 8


def test_fewer_drafts_than_slots_and_none_at_all():
    h = SpecHarness(block_size=4, k=6)
    seq = _decode_ready(h, prompt_len=4, max_tokens=30)
    h.step(propose=lambda s: [])                             # the proposer found nothing
    assert len(seq.output_token_ids) == 2 and len(seq.block_table) == 2
    h.step(propose=lambda s: [5, 5])
    assert len(seq.output_token_ids) == 5
    assert h.updates[-1].num_draft_proposed == 2


def test_per_sequence_num_speculative_tokens():
    h = SpecHarness(k=4)
    off = h.add("off", max_tokens=10, num_speculative_tokens=0)
    two = h.add("two", max_tokens=10, num_speculative_tokens=2)
    default = h.add("default", max_tokens=10)
    h.step()
    plan = h.schedule()
    slots = {s.seq_id: s.num_lookahead_slots for s in plan.scheduled}
    assert slots == {off.seq_id: 0, two.seq_id: 2, default.seq_id: 4}
    candidates = dict(h.controller.calls[-1][0])
    assert off.seq_id not in candidates and candidates[two.seq_id] == 2
    h.finish_step(plan)
    h.run()
    assert all(len(s.output_token_ids) == 10 for s in (off, two, default))


def test_max_tokens_never_exceeded_by_accepted_drafts():
    h = SpecHarness(k=8)
    seqs = [h.add(f"r{i}", prompt_len=5, max_tokens=m) for i, m in enumerate((1, 2, 3, 6, 13))]
    while h.sched.has_unfinished():
        plan = h.schedule()
        for s in plan.scheduled:
            seq = h.seq(s.seq_id)
            assert len(seq.output_token_ids) + s.num_lookahead_slots + 1 <= seq.max_tokens or not s.sample
        h.finish_step(plan)                                  # everything accepted
    assert [len(s.output_token_ids) for s in seqs] == [1, 2, 3, 6, 13]
    assert all(s.finish_reason is FinishReason.LENGTH for s in seqs)
    assert h.pool.num_free_blocks == h.pool.num_blocks


def test_drafts_never_run_past_the_context():
    h = SpecHarness(k=8, max_model_len=12)
    seq = h.add("a", prompt_len=6, max_tokens=6)             # exactly fills the context
    while h.sched.has_unfinished():
        plan = h.schedule()
        for s in plan.scheduled:
            assert s.context_len + s.num_lookahead_slots <= 12
        h.finish_step(plan)
    assert seq.num_tokens == 12


def test_stop_token_inside_accepted_drafts_ends_the_sequence_there():
    h = SpecHarness(block_size=4, k=4)
    seq = _decode_ready(h, prompt_len=4, max_tokens=20)
    updates = h.step(propose=lambda s: [7, EOS, 8, 9], accept=lambda s: 4, final=10)
    assert seq.output_token_ids == [7, 7, EOS]
    assert updates[0].new_token_ids == [7, EOS] and updates[0].finish_reason == "stop"
    assert (updates[0].num_draft_proposed, updates[0].num_draft_accepted) == (4, 4)
    assert seq.is_finished and not seq.block_table
    assert h.pool.num_free_blocks == h.pool.num_blocks


def test_stop_token_ids_and_ignore_eos_and_min_tokens_with_drafts():
    h = SpecHarness(block_size=4, k=4)
    stop = h.add("stop", max_tokens=20, stop_token_ids=[42])
    ignore = h.add("ignore", max_tokens=20, ignore_eos=True)
    early = h.add("min", max_tokens=20, min_tokens=3)
    h.step()                                                 # prefill: one token each
    h.step(propose=lambda s: [5, 42, EOS, 6], accept=lambda s: 4)
    assert stop.output_token_ids == [7, 5, 42] and stop.finish_reason is FinishReason.STOP
    assert ignore.output_token_ids == [7, 5, 42, EOS, 6, 7] and not ignore.is_finished
    # min_tokens: EOS as the 3rd output token is allowed (len >= min_tokens when checked)
    assert early.output_token_ids == [7, 5, 42, EOS] and early.finish_reason is FinishReason.STOP
    h.run()


def test_abort_mid_speculation_frees_draft_blocks():
    h = SpecHarness(block_size=4, k=4)
    _decode_ready(h, prompt_len=4, max_tokens=20)
    b = h.add("b", prompt_len=4, max_tokens=20)
    h.step()
    plan = h.schedule()
    assert all(s.num_lookahead_slots == 4 for s in plan.scheduled)
    h.sched.abort_request("a")                               # between schedule and update
    h.check(mid_step=True)
    h.finish_step(plan, accept=lambda s: 1)
    assert len(b.output_token_ids) == 3
    h.sched.abort_request("b")
    h.check()
    assert h.pool.num_free_blocks == h.pool.num_blocks
    assert not h.sched.has_unfinished()


def test_stop_string_finish_between_schedule_and_update():
    h = SpecHarness(block_size=4, k=4)
    seq = _decode_ready(h, prompt_len=4, max_tokens=20)
    plan = h.schedule()
    h.sched.finish_sequence(seq.seq_id, FinishReason.STOP)
    h.check(mid_step=True)
    h.finish_step(plan)
    assert seq.output_token_ids == [7]
    assert h.pool.num_free_blocks == h.pool.num_blocks


def test_drafts_never_preempt_anyone():
    # 5 blocks of 4: a holds 2 (prompt 6 + 1 output), b holds 2, one block free
    h = SpecHarness(num_blocks=5, block_size=4, k=8)
    a = h.add("a", prompt_len=6, max_tokens=30)
    b = h.add("b", prompt_len=6, max_tokens=30)
    h.step()
    plan = h.schedule()
    assert not plan.preempted_seq_ids
    slots = {s.seq_id: s.num_lookahead_slots for s in plan.scheduled}
    # a: the real token at 6, drafts up to the end of its blocks plus the free one (positions 7..11)
    assert slots[a.seq_id] == 5
    assert slots[b.seq_id] == 1                              # b: only its own block's slack is left
    assert h.pool.num_free_blocks == 0
    h.finish_step(plan, accept=lambda s: 0)
    assert a.status is SeqStatus.RUNNING and b.status is SeqStatus.RUNNING
    assert h.pool.num_free_blocks == 1


def test_draft_slots_capped_by_the_leftover_token_budget():
    h = SpecHarness(k=8, budget=10)
    h.add("a", prompt_len=4, max_tokens=30)
    h.add("b", prompt_len=4, max_tokens=30)
    h.step()                                                 # prefills: 8 of 10 tokens
    plan = h.schedule()
    assert sum(s.num_tokens + s.num_lookahead_slots for s in plan.scheduled) == 10
    h.finish_step(plan)


@pytest.mark.parametrize("prefix_cache", [False, True])
@pytest.mark.parametrize("seed", range(8))
def test_bursts_of_rejections_aborts_and_preemptions_keep_integrity(prefix_cache, seed):
    """Random proposals, acceptance counts and stop tokens on a tight pool; some
    requests are aborted mid-speculation. Every step: free + used == total, ref
    counts match the block tables, no draft block outlives its step."""
    rng = random.Random(seed)
    h = SpecHarness(num_blocks=20, block_size=4, max_num_seqs=6, budget=48, k=6, prefix_cache=prefix_cache)
    requests = {}
    for i in range(14):
        prompt = [rng.randrange(1, 6) for _ in range(rng.randrange(2, 14))]   # small vocab: cache hits
        n = 2 if i % 5 == 4 else 1
        requests[f"r{i}"] = h.add(f"r{i}", prompt=prompt, max_tokens=rng.randrange(4, 40), n=n,
                                  ignore_eos=i % 3 == 0, num_speculative_tokens=rng.choice([None, None, 0, 2]))
    aborted = set()
    for step in range(2000):
        if not h.sched.has_unfinished():
            break
        plan = h.schedule(propose=lambda s: [rng.choice([1, 2, 3, EOS if rng.random() < 0.05 else 4])
                                             for _ in range(rng.randrange(0, s.num_lookahead_slots + 1))])
        if step % 7 == 3:                                    # an abort between schedule and update
            live = [rid for rid, seq in requests.items() if not seq.is_finished and rid not in aborted]
            if live:
                victim = rng.choice(live)
                aborted.add(victim)
                h.sched.abort_request(victim)
                h.check(mid_step=True)
        h.finish_step(plan, accept=lambda s: rng.choice([0, 0, len(s.lookahead_token_ids),
                                                         rng.randrange(len(s.lookahead_token_ids) + 1)]),
                      final=lambda s: EOS if rng.random() < 0.03 else rng.randrange(1, 6))
    else:
        raise AssertionError("did not finish")
    assert h.sched.num_preemptions > 0, "the pool was meant to force preemption"
    assert sum(len(p.scheduled) for p in h.plans) > 0
    assert any(u.num_draft_accepted for u in h.updates) and any(
        u.num_draft_accepted < u.num_draft_proposed for u in h.updates)
    assert h.pool.num_used_blocks == 0
    for seq in h.seqs:
        assert seq.is_finished
        assert len(seq.output_token_ids) <= seq.max_tokens
        if seq.finish_reason is FinishReason.STOP:
            assert seq.output_token_ids[-1] == EOS and EOS not in seq.output_token_ids[:-1]
        if seq.finish_reason is FinishReason.LENGTH:
            assert len(seq.output_token_ids) == seq.max_tokens
    print(f"seed {seed} cache {prefix_cache}: {len(h.plans)} steps, {h.sched.num_preemptions} preemptions, "
          f"{sum(u.num_draft_proposed for u in h.updates)} drafts, "
          f"{sum(u.num_draft_accepted for u in h.updates)} accepted")
