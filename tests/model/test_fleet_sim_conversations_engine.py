"""Tier 2: closed-loop conversations on the real engine (``fleetsim/validate.py``) against the
simulator's engine-scheduler replica with its prefix cache: a later turn goes out only after its
previous answer plus the gap, carries the engine's own answer, and is served from the engine's
cache exactly as much as the simulated cache serves it (its whole history, to the block)."""
from __future__ import annotations

import functools

import pytest

from kvserve.fleetsim.sched_replica import BLOCK_SIZE, SchedulerReplica
from kvserve.fleetsim.validate import make_trace, run_engine_trace, simulate_trace

pytestmark = pytest.mark.model
GAP_S = 0.1


def test_closed_loop_turns_on_the_engine_hit_what_the_simulator_hits(llm):
    from kvserve.planner.dtypes import kv_dtype, weight_dtype
    from kvserve.planner.hardware import resolve_hardware
    from kvserve.planner.profile import model_from_engine
    from kvserve.planner.roofline import cost_model
    trace = make_trace(14, 8.0, 48, 40, seed=3, turns=3.0, turn_gap_s=GAP_S)   # answers span blocks
    follow_ups = [r for r in range(len(trace)) if trace.parent[r] >= 0]
    assert len(follow_ups) >= 5 and any(trace.parent[trace.parent[r]] >= 0 for r in follow_ups)   # third turns too
    measured = run_engine_trace(llm, trace, llm.engine.model_config.vocab_size, turn_gap_s=GAP_S)
    cost = cost_model(model_from_engine(llm.engine.model_config), resolve_hardware("h100-sxm"), weight_dtype("fp32"),
                      kv_dtype("fp32"), 1)
    simulated = simulate_trace(trace, cost, llm.config.max_num_seqs, llm.config.max_num_batched_tokens,
                               llm.engine.kv_plan.max_tokens, functools.partial(SchedulerReplica, prefix_cache=True),
                               turn_gap_s=GAP_S)
    for log in (measured, simulated):
        for r in follow_ups:
            parent = trace.parent[r]
            assert log.arrival[r] >= max(trace.arrival[r], log.finish_s[parent] + GAP_S)
            history = trace.prompt[parent] + trace.output[parent]
            assert log.cached_tokens[r] == (history - 1) // BLOCK_SIZE * BLOCK_SIZE, (r, log.cached_tokens[r])
    assert measured.cached_tokens == simulated.cached_tokens
    llm.engine.check_integrity()
