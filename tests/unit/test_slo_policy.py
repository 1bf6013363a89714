"""The SLO scheduling policy through the real scheduler and KV manager (no model):
ordering from the step plans, the TPOT-shaped budget, preemption order, the batching
window, starvation bounds and keystroke cancellations."""
from __future__ import annotations

import random

import pytest

from kvserve.engine.service_class import ServiceClass, class_for_tier, parse_class
from kvserve.engine.slo_policy import ClassTargets, SloPolicy, SloPolicySettings, DEFAULT_TARGETS
from kvserve.engine.step import SampledToken
from tests.support.scheduler_harness import SchedulerHarness

I, C, B = ServiceClass.INTERACTIVE, ServiceClass.CHAT, ServiceClass.BATCH
NUM_KEYSTROKES = 1000


def harness(window_s: float = 0.0, passed_over: int = 32, **kw) -> SchedulerHarness:
    settings = SloPolicySettings(dict(DEFAULT_TARGETS), window_s, passed_over, min_step_tokens=4)
    return SchedulerHarness(policy=SloPolicy(settings), **kw)


def add(h: SchedulerHarness, rid: str, prompt, cls: ServiceClass, **kw):
    return h.add(rid, prompt, request_kw={"service_class": cls, **kw.pop("request_kw", {})}, **kw)


def scheduled_ids(plan) -> set[int]:
    return {item.seq_id for item in plan.scheduled}


def test_tiers_map_to_classes():
    assert class_for_tier("priority") is I and class_for_tier("flex") is B
    assert class_for_tier("default") is C and class_for_tier("auto") is C
    assert parse_class("batch") is B and parse_class("priority") is I
    with pytest.raises(ValueError, match="interactive"):
        parse_class("gold")


def test_interactive_enters_the_next_step_while_batch_saturates():
    h = harness(budget=32, max_num_seqs=16, num_blocks=256)
    batch = [add(h, f"b{i}", 40, B, max_tokens=30) for i in range(6)]
    for _ in range(3):
        plan, _ = h.step()
        assert plan.num_tokens == 32                  # saturated: the whole budget is batch prefill
    inter = add(h, "i", 12, I, max_tokens=4)
    plan, _ = h.step()
    assert inter.seq_id in scheduled_ids(plan)
    assert next(i for i in plan.scheduled if i.seq_id == inter.seq_id).num_tokens == 12   # whole prompt
    assert plan.scheduled[0].seq_id == inter.seq_id or any(b.seq_id in scheduled_ids(plan) for b in batch)
    h.run()
    assert all(h.finished[(f"b{i}", 0)] == "length" for i in range(6))


def test_interactive_is_admitted_even_when_the_fcfs_order_would_not():
    fcfs = SchedulerHarness(budget=32, max_num_seqs=16, num_blocks=256)
    for i in range(6):
        fcfs.add(f"b{i}", 40, max_tokens=30)
    for _ in range(3):
        fcfs.step()
    late = fcfs.add("i", 12, max_tokens=4)
    plan, _ = fcfs.step()
    assert late.seq_id not in scheduled_ids(plan)     # FCFS: the running prefills take the budget


def test_batch_progresses_under_sustained_interactive_load():
    h = harness(budget=8, max_num_seqs=16, num_blocks=512, passed_over=5)
    batch = add(h, "b", 4, B, max_tokens=20)
    for step in range(60):
        add(h, f"i{step}", 8, I, max_tokens=2)       # a full budget of interactive work each step
        h.step()
    batch_steps = [n for n, plan in enumerate(h.plans) if batch.seq_id in scheduled_ids(plan)]
    gaps = [b - a for a, b in zip(batch_steps, batch_steps[1:])]
    assert len(batch_steps) >= 60 // 7 and max(gaps) <= 7   # at least once per passed_over + 1 steps


def test_a_backlog_of_its_own_class_does_not_age_past_interactive():
    """Chat requests waiting behind chat (all slots full) are not starved: they do not age
    into the interactive rank, so an interactive request arriving after 100 such steps
    takes the first slot that frees, ahead of every waiting chat request (before, the
    aged backlog ranked as interactive and went first)."""
    h = harness(budget=16, max_num_seqs=4, num_blocks=512, passed_over=32)
    chats = [add(h, f"c{i}", 8, C, max_tokens=40) for i in range(60)]
    for _ in range(100):
        h.step()
    waiting = {c.seq_id for c in chats if c.num_computed_tokens == 0}
    inter = add(h, "i", 8, I, max_tokens=2)
    for _ in range(60):
        plan, _ = h.step()
        started = scheduled_ids(plan) & (waiting | {inter.seq_id})
        if started:
            assert started == {inter.seq_id}
            return
    raise AssertionError("the interactive request never ran")


def test_tpot_shaped_budget_while_interactive_decodes():
    policy = SloPolicy(SloPolicySettings(dict(DEFAULT_TARGETS), min_step_tokens=4))
    for tokens in (1, 8, 64, 256):                     # 10 ms + 1 ms per token
        policy.step_time.observe(tokens, 0.010 + 0.001 * tokens)
    h = SchedulerHarness(policy=policy, budget=256, max_num_seqs=8, num_blocks=512)
    add(h, "i", 4, I, max_tokens=50)
    h.step()                                           # prefill: the interactive sequence now decodes
    add(h, "c", 300, C, max_tokens=4)
    plan, _ = h.step()
    tpot_tokens = int((DEFAULT_TARGETS[I].tpot_s - 0.010) / 0.001)     # 40
    assert plan.num_tokens == tpot_tokens
    h.sched.abort_request("i")
    plan, _ = h.step()
    assert plan.num_tokens == 256                      # no interactive decode: the whole budget


def test_unreachable_tpot_keeps_steps_at_twice_their_fixed_cost():
    policy = SloPolicy(SloPolicySettings(dict(DEFAULT_TARGETS), min_step_tokens=4))
    for tokens in (1, 64, 512):                        # 80 ms + 0.5 ms per token: 50 ms is out of reach
        policy.step_time.observe(tokens, 0.080 + 0.0005 * tokens)
    h = SchedulerHarness(policy=policy, budget=1024, max_num_seqs=8, num_blocks=512)
    add(h, "i", 4, I, max_tokens=50)
    h.step()
    add(h, "c", 600, C, max_tokens=4)
    plan, _ = h.step()
    assert plan.num_tokens == 160                      # a / b: the step costs 2 x 80 ms at most


def test_batch_is_preempted_before_interactive():
    h = harness(budget=64, max_num_seqs=8, num_blocks=12, block_size=4)
    inter = add(h, "i", 8, I, max_tokens=24)
    batch = add(h, "b", 8, B, max_tokens=24)
    chat = add(h, "c", 8, C, max_tokens=24)
    preempted = []
    for _ in range(40):
        if not h.sched.has_unfinished():
            break
        plan, _ = h.step()
        preempted += plan.preempted_seq_ids
    assert preempted and preempted[0] == batch.seq_id
    assert inter.num_preemptions == 0
    assert chat.num_preemptions <= batch.num_preemptions


def test_interactive_admission_preempts_batch_when_blocks_are_short():
    h = harness(budget=64, max_num_seqs=8, num_blocks=8, block_size=4)
    batch = add(h, "b", 24, B, max_tokens=8)           # 7 of 8 blocks
    h.step()
    inter = add(h, "i", 12, I, max_tokens=2)           # needs 3-4 blocks: only by preempting
    plan, _ = h.step()
    assert inter.seq_id in scheduled_ids(plan) and batch.seq_id in plan.preempted_seq_ids
    h.run()
    assert h.finished[("b", 0)] == "length" and h.finished[("i", 0)] == "length"


def test_chat_never_preempts_for_chat():
    h = harness(budget=64, max_num_seqs=8, num_blocks=8, block_size=4)
    first = add(h, "c1", 24, C, max_tokens=8)
    h.step()
    add(h, "c2", 12, C, max_tokens=2)
    plan, _ = h.step()
    assert plan.preempted_seq_ids == [] and scheduled_ids(plan) == {first.seq_id}


def test_batching_window_holds_batch_but_never_interactive():
    h = harness(window_s=0.05, budget=64, max_num_seqs=8, num_blocks=128)
    add(h, "b0", 4, B, max_tokens=2)
    plan, _ = h.step()
    assert plan.is_empty and h.sched.wake_in_s() == pytest.approx(0.05)
    inter = add(h, "i", 4, I, max_tokens=2)
    plan, _ = h.step()
    assert scheduled_ids(plan) == {inter.seq_id}       # interactive never waits
    h.clock.now = 0.02
    add(h, "b1", 4, B, max_tokens=2)
    plan, _ = h.step()
    assert all(h.seq(i.seq_id).service_class is not B for i in plan.scheduled)
    assert h.sched.wake_in_s() == pytest.approx(0.03)
    h.clock.now = 0.05                                  # the oldest batch request waited W
    plan, _ = h.step()
    assert {h.seq(i.seq_id).request_id for i in plan.scheduled} >= {"b0", "b1"}


def test_batching_window_releases_early_once_a_step_is_full():
    h = harness(window_s=10.0, budget=16, max_num_seqs=8, num_blocks=128)
    add(h, "b0", 8, B, max_tokens=2)
    assert h.step()[0].is_empty
    add(h, "b1", 8, B, max_tokens=2)                    # 16 tokens waiting = the budget
    plan, _ = h.step()
    assert plan.num_tokens == 16


def test_window_zero_is_plain_admission():
    h = harness(window_s=0.0, budget=16)
    add(h, "b0", 8, B, max_tokens=2)
    assert not h.step()[0].is_empty and h.sched.wake_in_s() is None


def test_class_mix_does_not_change_tokens_of_a_scripted_run():
    """With a runner that samples a token from each sequence's own history, any class mix
    yields the same tokens per request as FCFS (classes change timing, never tokens)."""
    def run(classes, policy_harness):
        h = policy_harness
        for i, cls in enumerate(classes):
            add(h, f"r{i}", 5 + 3 * i, cls, max_tokens=6)
        for _ in range(200):
            if not h.sched.has_unfinished():
                break
            plan = h.sched.schedule()
            result = h.result(plan)
            for item in plan.scheduled:
                if item.sample:
                    history = item.prompt_token_ids + item.output_token_ids
                    result.sampled[item.seq_id] = SampledToken(1 + sum(history) % 97)
            h.record(h.sched.update(plan, result))
            h.check()
        return {rid: [t for u in h.updates if u.request_id == rid for t in u.new_token_ids]
                for rid in {u.request_id for u in h.updates}}
    mix = [I, B, C, B, I, C, B]
    fcfs = run(mix, SchedulerHarness(budget=12, num_blocks=40, block_size=4))
    slo = run(mix, harness(window_s=0.0, budget=12, num_blocks=40, block_size=4))
    assert fcfs == slo and len(fcfs) == len(mix) and all(len(t) == 6 for t in fcfs.values())


def test_class_targets_resolve_over_the_defaults():
    from kvserve.engine.config import EngineConfig, resolve_slo
    from kvserve.errors import InvalidRequestError
    slo = resolve_slo(EngineConfig(class_targets={"priority": {"tpot_s": 0.1}}, batch_window_s=0.05))
    assert slo.targets[I] == ClassTargets(DEFAULT_TARGETS[I].ttft_s, 0.1, True)
    assert slo.targets[B] == DEFAULT_TARGETS[B] and slo.batch_window_s == 0.05
    assert resolve_slo(EngineConfig(scheduling_policy="fcfs")) is None
    for bad in ({"gold": {}}, {"chat": {"latency": 1}}):
        with pytest.raises(InvalidRequestError):
            resolve_slo(EngineConfig(class_targets=bad))
    with pytest.raises(InvalidRequestError, match="scheduling_policy"):
        resolve_slo(EngineConfig(scheduling_policy="edf"))


def test_a_thousand_keystroke_cancellations():
    """An editor aborts the previous inline request on every keystroke and sends the next
    prompt, which extends it: slots are freed at once, KV stays accounted for, and the
    next keystroke's request hits the aborted one's cached blocks."""
    h = harness(budget=64, max_num_seqs=16, num_blocks=96, block_size=4, prefix_cache=True, grace_s=30.0)
    rng = random.Random(0)
    add(h, "chat", 20, C, max_tokens=200)              # background traffic
    text = [rng.randrange(2, 500) for _ in range(48)]
    cached = []
    for key in range(NUM_KEYSTROKES):
        if len(text) > 160:                             # a new file region: the window moves on
            text = text[-48:]
        text += [rng.randrange(2, 500) for _ in range(rng.randint(1, 2))]
        seq = add(h, f"k{key}", list(text), I, max_tokens=8)
        for _ in range(rng.randint(1, 2)):
            h.step()
        cached.append(seq.num_cached_tokens)
        updates = h.sched.abort_request(f"k{key}")
        assert seq.is_finished and seq.block_table == []
        h.record(updates)
        h.check()
        assert h.sched.num_running <= 1
    assert h.sched.request_status(f"k{NUM_KEYSTROKES - 1}") is None
    h.sched.abort_request("chat")
    h.check()
    assert h.pool.num_used_blocks == 0
    hits = [c for c in cached[1:] if c > 0]
    assert len(hits) >= 0.9 * NUM_KEYSTROKES                             # follow-ups hit the previous keystroke's blocks


def test_cached_interactive_prompt_leaves_chat_its_decode():
    """Admission ahead of lower classes takes what the request really computes (its prefix
    hit is not charged), so chat keeps decoding beside a keystroke whose prompt is cached."""
    h = harness(budget=16, max_num_seqs=8, num_blocks=128, block_size=4, prefix_cache=True, grace_s=30.0)
    first = add(h, "i0", list(range(2, 42)), I, max_tokens=1)
    h.run()
    chat = add(h, "c", 8, C, max_tokens=40)
    h.step()
    nxt = add(h, "i1", list(range(2, 44)), I, max_tokens=1)
    plan, _ = h.step()
    assert {nxt.seq_id, chat.seq_id} <= scheduled_ids(plan)
    assert nxt.num_cached_tokens >= 36 and first.is_finished


class RefuseGate:
    """A residency gate that never admits the sequences it names (an adapter with no slot)."""

    def __init__(self, refused: set[int]):
        self.refused = refused

    def register(self, seq_id, key): pass
    def acquire(self, seq_id): return seq_id not in self.refused
    def release(self, seq_id): pass
    def share(self, child, leader): pass
    def forget(self, seq_id): pass


def test_a_refused_interactive_head_does_not_stall_the_step():
    gate = RefuseGate(set())
    h = harness(budget=16, max_num_seqs=8, num_blocks=64, gate=gate)
    chats = [add(h, f"c{i}", 4, C, max_tokens=20) for i in range(3)]
    h.step()
    blocked = add(h, "i", 4, I, max_tokens=2)
    gate.refused.add(blocked.seq_id)
    plan, _ = h.step()
    assert scheduled_ids(plan) == {c.seq_id for c in chats}
    assert h.sched.request_status("i").value == "waiting"
