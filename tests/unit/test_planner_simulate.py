"""The planner's simulation is the engine's own Scheduler run without a model (tier 1).

``schedule_offline`` drives the real scheduler, so these tests check the properties every
engine run has, plus hand-worked examples with exact step shapes.
"""
from __future__ import annotations

import os
import random
import subprocess
import sys

import pytest

from kvserve.planner.simulate import SchedulerLimits, StepShape, schedule_offline, scheduled_steps

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _request_sets():
    rng = random.Random(11)
    sets = [([(5, 2), (6, 1)], SchedulerLimits(64, 8)),
            ([(1, 1)], SchedulerLimits(1, 1)),
            ([(300, 3)] * 3, SchedulerLimits(2, 64, 16)),
            ([(4, 3), (4, 3)], SchedulerLimits(64, 16, 4, num_blocks=3))]     # preempts
    for _ in range(6):
        requests = [(rng.randint(1, 200), rng.randint(1, 30)) for _ in range(rng.randint(1, 30))]
        sets.append((requests, SchedulerLimits(rng.choice([1, 4, 16]), rng.choice([7, 64, 256]),
                                               rng.choice([1, 16]))))
    return sets


@pytest.mark.parametrize("requests, limits", _request_sets())
def test_steps_respect_the_limits_and_produce_every_output(requests, limits):
    steps = schedule_offline(requests, limits)
    assert sum(s.num_sampled for s in steps) == sum(o for _, o in requests)
    for step in steps:
        assert 0 < sum(n for _, n in step.chunks) <= limits.max_num_batched_tokens
        assert 0 < len(step.chunks) <= limits.max_num_seqs
        assert step.num_sampled <= len(step.chunks)


@pytest.mark.parametrize("requests, limits", _request_sets())
def test_each_sequence_computes_its_prompt_then_samples_one_token_a_step(requests, limits):
    computed = [0] * len(requests)
    outputs = [0] * len(requests)
    for plan in scheduled_steps(requests, limits):
        for s in plan.scheduled:
            i, (prompt, _) = s.seq_id, requests[s.seq_id]
            assert len(s.prompt_token_ids) == prompt
            assert outputs[i] < requests[i][1]                   # finished sequences never run
            if s.start_position < computed[i]:                    # recompute after preemption
                assert s.start_position == 0
            else:
                assert s.start_position == computed[i]
            computed[i] = s.start_position + s.num_tokens
            assert s.sample == (computed[i] == prompt + outputs[i])
            if s.sample:
                assert computed[i] >= prompt                      # whole prompt before the first sample
                outputs[i] += 1
    assert outputs == [o for _, o in requests]


def test_hand_checked_budget_of_eight():
    # step 1: A's whole prompt (samples), B's first 3 tokens (budget gone);
    # step 2: A decodes its 2nd and last token, B finishes its prompt and samples its only one
    assert schedule_offline([(5, 2), (6, 1)], SchedulerLimits(64, 8)) == [
        StepShape(((0, 5), (0, 3)), 1),
        StepShape(((5, 1), (3, 3)), 2)]


def test_hand_checked_one_sequence_at_a_time():
    # B waits, with budget left, until A has left the running set
    assert schedule_offline([(5, 2), (6, 1)], SchedulerLimits(1, 8)) == [
        StepShape(((0, 5),), 1), StepShape(((5, 1),), 1), StepShape(((0, 6),), 1)]


def test_hand_checked_preemption_in_a_small_pool():
    # 3 blocks of 4 tokens: both prompts fit (1 block each) and sample; then A's decode takes the
    # last free block, B finds none and preempts itself; B is re-admitted (prompt + its token,
    # recomputed) only after A finishes and frees its blocks
    assert schedule_offline([(4, 3), (4, 3)], SchedulerLimits(64, 16, 4, num_blocks=3)) == [
        StepShape(((0, 4), (0, 4)), 2),
        StepShape(((4, 1),), 1),
        StepShape(((5, 1),), 1),
        StepShape(((0, 5),), 1),
        StepShape(((5, 1),), 1)]


def test_default_pool_never_preempts():
    requests = list(zip(range(50, 1050, 50), range(1, 41, 2)))
    for plan in scheduled_steps(requests, SchedulerLimits(8, 128)):
        assert not plan.preempted_seq_ids


def test_impossible_inputs_raise():
    with pytest.raises(ValueError, match="KV blocks"):
        schedule_offline([(8, 1)], SchedulerLimits(4, 16, 4, num_blocks=1))
    with pytest.raises(ValueError, match="prompt and output"):
        schedule_offline([(4, 0)], SchedulerLimits())
    assert schedule_offline([], SchedulerLimits()) == []


def test_planner_simulation_imports_without_torch():
    code = "import sys, kvserve.planner.simulate; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)
