"""Tier 1: the scheduler driven by hand-built step results (no model, no torch)."""
import pytest

from kvserve.engine.sequence import FinishReason
from kvserve.engine.step import SampledToken, StepResult
from tests.support.scheduler_harness import EOS, SchedulerHarness


class Harness(SchedulerHarness):
    """The shared harness with requests sized by prompt length."""

    def add(self, request_id, prompt_len, max_tokens=8, n=1, priority=0, **kw):
        return super().add(request_id, prompt_len, max_tokens, n, priority, **kw)


def test_finish_frees_everything():
    h = Harness()
    h.add("a", prompt_len=10, max_tokens=5)
    h.add("b", prompt_len=3, max_tokens=2)
    h.run()
    assert h.finished == {("a", 0): "length", ("b", 0): "length"}
    assert h.pool.num_free_blocks == h.pool.num_blocks


def test_eos_stops_unless_ignored():
    h = Harness()
    h.add("a", prompt_len=4, max_tokens=5)
    h.add("b", prompt_len=4, max_tokens=5, ignore_eos=True)
    while h.sched.has_unfinished():
        h.step(token=EOS)
    assert h.finished == {("a", 0): "stop", ("b", 0): "length"}


def test_chunked_prefill_respects_budget():
    h = Harness(budget=8)
    seq = h.add("a", prompt_len=30, max_tokens=2)
    plan, _ = h.step()
    assert [s.num_tokens for s in plan.scheduled] == [8]
    assert not plan.scheduled[0].sample                  # mid-prompt: nothing sampled
    h.run()
    assert seq.output_token_ids == [7, 7]
    assert h.pool.num_free_blocks == h.pool.num_blocks


def test_decode_first_then_prefill_shares_the_budget():
    h = Harness(budget=8)
    h.add("a", prompt_len=4, max_tokens=10)
    h.step()                                             # a: prefill
    h.add("b", prompt_len=20, max_tokens=2)
    plan, _ = h.step()
    assert [(s.num_tokens, s.sample) for s in plan.scheduled] == [(1, True), (7, False)]


def test_abort_mid_prefill_and_mid_decode():
    h = Harness(budget=8)
    h.add("a", prompt_len=30, max_tokens=4)
    h.add("b", prompt_len=4, max_tokens=50)
    h.step()
    updates = h.sched.abort_request("a")                 # a is mid-prefill
    assert [u.finish_reason for u in updates] == ["abort"]
    h.check()
    for _ in range(5):
        h.step()
    h.sched.abort_request("b")                           # b is decoding
    h.check()
    assert not h.sched.has_unfinished()
    assert h.pool.num_free_blocks == h.pool.num_blocks
    assert h.sched.abort_request("b") == []              # aborting twice is harmless


def test_abort_between_schedule_and_update():
    h = Harness()
    h.add("a", prompt_len=4, max_tokens=4)
    plan = h.sched.schedule()
    h.sched.abort_request("a")
    h.sched.update(plan, StepResult({s.seq_id: SampledToken(7) for s in plan.scheduled}))
    h.check()
    assert h.pool.num_free_blocks == h.pool.num_blocks


def test_preemption_newest_first_then_recompute():
    # 6 blocks of 4 tokens; two sequences of 8-token prompts growing to 20 tokens each.
    h = Harness(num_blocks=6, block_size=4, budget=64)
    old = h.add("old", prompt_len=8, max_tokens=12)
    new = h.add("new", prompt_len=8, max_tokens=12)
    preempted = []
    while h.sched.has_unfinished():
        plan, _ = h.step()
        preempted += plan.preempted_seq_ids
    assert preempted and preempted[0] == new.seq_id      # the newest goes first
    assert old.num_preemptions == 0
    assert old.output_token_ids == [7] * 12 and new.output_token_ids == [7] * 12
    assert h.pool.num_free_blocks == h.pool.num_blocks


def test_priority_orders_admission_and_preemption():
    h = Harness(num_blocks=6, block_size=4, max_num_seqs=1)
    low = h.add("low", prompt_len=4, max_tokens=2, priority=5)
    high = h.add("high", prompt_len=4, max_tokens=2, priority=0)
    plan, _ = h.step()
    assert [s.seq_id for s in plan.scheduled] == [high.seq_id]
    h.run()
    assert low.output_token_ids == [7, 7]


def test_fcfs_head_of_line_is_not_overtaken():
    h = Harness(num_blocks=4, block_size=4, budget=64)
    h.add("a", prompt_len=8, max_tokens=1)               # 2 blocks (+1 to sample)
    big = h.add("big", prompt_len=12, max_tokens=1)      # needs 3-4 blocks: must wait
    small = h.add("small", prompt_len=2, max_tokens=1)
    plan, _ = h.step()
    assert big.seq_id not in [s.seq_id for s in plan.scheduled]
    assert small.seq_id not in [s.seq_id for s in plan.scheduled]
    h.run()


@pytest.mark.parametrize("prompt_len", [1, 4, 5, 9])
def test_n_siblings_share_prompt_blocks(prompt_len):
    h = Harness(block_size=4)
    leader = h.add("a", prompt_len=prompt_len, max_tokens=3, n=3)
    children = list(leader.pending_fork)
    forked = False
    while h.sched.has_unfinished():
        plan, _ = h.step()
        if plan.block_copies or (children and children[0].block_table):
            if not forked:
                forked = True
                full = (prompt_len - 1) // 4
                for c in children:
                    assert c.block_table[:full] == leader.block_table[:full]
                    for b in leader.block_table[:full]:
                        assert h.pool.ref_count(b) == 3
                partial = (prompt_len - 1) % 4 != 0
                assert len(plan.block_copies) == (2 if partial else 0)
    assert forked
    assert sorted(h.finished) == [("a", 0), ("a", 1), ("a", 2)]
    assert h.pool.num_free_blocks == h.pool.num_blocks


def test_n_siblings_abort_before_fork_and_under_preemption():
    h = Harness(num_blocks=8, block_size=4, budget=4)
    h.add("a", prompt_len=12, max_tokens=3, n=4)
    h.step()
    updates = h.sched.abort_request("a")                 # before the fork
    assert sorted(u.sibling_index for u in updates) == [0, 1, 2, 3]
    h.check()
    h.add("b", prompt_len=9, max_tokens=6, n=3)
    h.add("c", prompt_len=9, max_tokens=6)
    h.run()                                              # tight pool: preemptions happen
    assert h.sched.num_preemptions > 0
    assert h.pool.num_free_blocks == h.pool.num_blocks


def test_finish_sequence_for_stop_strings():
    h = Harness()
    seq = h.add("a", prompt_len=4, max_tokens=10)
    h.step()
    h.sched.finish_sequence(seq.seq_id, FinishReason.STOP)
    h.check()
    assert not h.sched.has_unfinished()
