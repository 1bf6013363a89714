"""Tier 1: the timing of the simulator-vs-cluster check's autoscaler (``cluster_check.
simulate_autoscaled``, ``fleetsim/scaling.ModelScaler``): a down step falls due when the
stabiliser's window has passed, between two decisions, as kvserve's policy on Ray Serve's
controller takes it; and the probe sent before the trace (``lead_in``) is played first, so the
autoscaler's first windows hold its load, and left out of the result."""
from __future__ import annotations

import math

import numpy as np
import pytest

from kvserve.autoscale.capacity import ReplicaCapacity
from kvserve.autoscale.tiers import ResidencyTier
from kvserve.cluster.autoscaling import AutoscaleSettings
from kvserve.fleetsim.cluster_check import (DecisionClock, cluster_decision_clock, compare_windows, phased_trace,
                                            ray_decision_timing, shift_steps, simulate_autoscaled, windows_as_loads)
from kvserve.fleetsim.log import RequestLog
from kvserve.fleetsim.scaling import POLICIES, ModelScaler
from kvserve.fleetsim.sizing import ColdStartLayers, ReplicaSizing
from kvserve.planner.dtypes import kv_dtype, weight_dtype
from kvserve.planner.hardware import CATALOG
from kvserve.planner.presets import preset
from kvserve.planner.roofline import cost_model

COST = cost_model(preset("llama-3-8b"), CATALOG["h100-sxm"], weight_dtype("bf16"), kv_dtype("bf16"), 1)
SETTINGS = AutoscaleSettings("tokens", "hot", 1, 2, prefill_tokens_per_s=2000.0, decode_tokens_per_s=200.0,
                             demand_window_s=5.0, downscale_window_s=20.0)
START_S = 3.0


def _simulate(trace: RequestLog, lead_in=None, clock: DecisionClock | None = None):
    return simulate_autoscaled(trace, COST, 4, 1024, 100_000, SETTINGS, START_S, lead_in=lead_in, clock=clock)


def _ups(steps) -> list[float]:
    return [t for (t, n), (_, before) in zip(steps[1:], steps) if n > before and t > 0]


def _scaler() -> ModelScaler:
    sizing = ReplicaSizing("m", 1, 4, 1024, 100_000, COST, ReplicaCapacity(2000.0, 200.0), 0.0,
                           ColdStartLayers(0.0, 0.0, 0.0, 0.0))
    return ModelScaler(POLICIES["tiers_tokens"], sizing, 1.25, 20.0, 2, 1)


def test_the_scaler_steps_down_when_its_window_has_passed_on_the_input_it_holds():
    scaler, hot = _scaler(), ResidencyTier.HOT
    busy = {"r": (20_000.0, 2_000.0, 4, 0, 0.0, 0)}       # 20k prompt and 2k output tokens over 6 s
    assert scaler.decide(0.0, hot, 1, {"r": (0.0, 0.0, 0, 0, 0.0, 0)}, 0) == 1
    assert scaler.decide(6.0, hot, 1, busy, 0) == 2
    assert scaler.down_due_s() is None
    assert scaler.decide(12.0, hot, 2, busy, 0) == 2           # nothing since: the count waits to go down
    assert scaler.down_due_s() == pytest.approx(32.0)
    assert scaler.recheck(31.9, hot, 2) == 2
    assert scaler.recheck(32.0, hot, 2) == 1
    assert scaler.down_due_s() is None


def test_a_decision_reads_the_replicas_earlier_than_it_is_made():
    scaler, hot = _scaler(), ResidencyTier.HOT
    scaler.decide(4.0, hot, 1, {"r": (0.0, 0.0, 0, 0, 0.0, 0)}, 0, read_at=0.0)
    assert scaler.decide(10.0, hot, 1, {"r": (20_000.0, 2_000.0, 4, 0, 0.0, 0)}, 0, read_at=6.0) == 2
    assert scaler.scrape.time_s == 6.0 and scaler.state.time_s == 10.0


def test_the_simulated_cluster_steps_down_a_window_after_a_decision_not_at_a_later_one():
    clock = ray_decision_timing(SETTINGS.demand_window_s)
    interval, delay = clock.interval_s, clock.delay_s
    _, steps = _simulate(phased_trace([(20.0, 6.0), (40.0, 0.2)], 128, 24, seed=0))
    ups = _ups(steps)
    downs = [t for (t, n), (_, before) in zip(steps[1:], steps) if n < before]
    assert ups and len(downs) == 1, steps
    # decisions are made at tick + delay; the count went below at one and stepped down a window later
    since_decision = (downs[0] - delay - SETTINGS.downscale_window_s) % interval
    assert min(since_decision, interval - since_decision) == pytest.approx(0.0, abs=1e-9), steps


def test_a_probe_just_before_a_light_trace_scales_it_up_early():
    trace = phased_trace([(30.0, 0.3)], 128, 24, seed=0)
    probe = phased_trace([(10.0, 8.0)], 128, 24, seed=1)
    alone, alone_steps = _simulate(trace)
    after, after_steps = _simulate(trace, lead_in=(probe, 11.0))
    assert max(n for _, n in alone_steps) == 1
    assert any(n == 2 and t < 10.0 for t, n in after_steps), after_steps
    assert len(after) == len(trace) and after.arrival == trace.arrival
    assert np.isfinite(after.arrays()["ttft_s"]).all()


def test_a_lead_in_long_before_leaves_the_trace_as_it_was():
    trace = phased_trace([(30.0, 2.0)], 128, 24, seed=0)
    one = RequestLog([0.0], [0], [0], [64], [8])
    alone, alone_steps = _simulate(trace)
    after, after_steps = _simulate(trace, lead_in=(one, 60.0))
    np.testing.assert_allclose(after.arrays()["ttft_s"], alone.arrays()["ttft_s"], atol=1e-9)
    np.testing.assert_allclose(after.arrays()["tpot_s"], alone.arrays()["tpot_s"], atol=1e-9)
    assert [(round(t, 6), n) for t, n in after_steps] == [(round(t, 6), n) for t, n in alone_steps[1:]]


def test_a_log_followed_by_another_and_its_part_back():
    first = RequestLog([0.0, 1.0], [0, 0], [0, 0], [10, 20], [2, 3], prefix_group=[0, -1], prefix_len=[4, 0])
    later = RequestLog([0.5, 2.0], [0, 0], [1, 1], [30, 40], [4, 5], prefix_group=[0, 0], prefix_len=[8, 8],
                       parent=[-1, 0])
    both = first.followed_by(later, 3.0)
    assert both.arrival == [0.0, 1.0, 3.5, 5.0] and both.prompt == [10, 20, 30, 40]
    assert both.prefix_group == [0, -1, 1, 1] and both.parent == [-1, -1, -1, 2]
    both.first_token(3, 6.0)
    both.finish(3, 7.0)
    part = both.part_from(2, 3.0)
    assert part.arrival == later.arrival and part.parent == later.parent and part.output == later.output
    assert part.first_token_s[1] == 3.0 and part.finish_s[1] == 4.0 and np.isnan(part.first_token_s[0])
    with pytest.raises(ValueError):
        later.followed_by(first, 0.0)


def test_shifted_steps_start_at_zero_with_the_count_then():
    assert shift_steps([(0.0, 0), (0.0, 1), (2.0, 2), (15.0, 1)], 10.0) == [(0.0, 2), (5.0, 1)]
    assert shift_steps([(0.0, 1)], 10.0) == [(0.0, 1)]
    assert shift_steps([(12.0, 2)], 10.0) == [(2.0, 2)]


def test_the_cluster_decision_clock_is_read_off_its_closed_windows():
    start = 1_000.0                                  # the trace's start on the wall clock
    reads = [start - 13.0 + 5.98 * k + jitter for k, jitter in enumerate([0.0, 0.03, -0.02, 0.01, 0.0, 0.02, -0.01])]
    windows = [[r, r + 1.9, 100.0, 10.0] for r in reads]
    clock = cluster_decision_clock(windows, start, ray_decision_timing(5.0))
    assert clock.interval_s == pytest.approx(5.98, abs=0.03) and clock.delay_s == pytest.approx(1.9)
    assert clock.phase_s == pytest.approx(-13.0, abs=0.03)
    assert clock.first_tick_s() == pytest.approx(-13.0 + 3 * 5.98, abs=0.1)       # 4.94: the first after 0
    assert clock.on_clock_from(-11.0).first_tick_s() == pytest.approx(-2.0 + 5.98, abs=0.05)
    assert cluster_decision_clock(windows[:1], start, ray_decision_timing(5.0)) == ray_decision_timing(5.0)


def test_the_windows_phase_moves_the_scale_up_with_it():
    trace = phased_trace([(10.0, 0.2), (30.0, 6.0)], 128, 24, seed=0)
    ups = {}
    for phase in (1.0, 4.0):
        clock = DecisionClock(6.0, 1.5, phase)
        _, steps = _simulate(trace, clock=clock)
        ups[phase] = _ups(steps)[0]
        # the replica serves START_S after a decision, made 1.5 s after a reading on the phase's grid
        assert math.remainder(ups[phase] - START_S - 1.5 - phase, 6.0) == pytest.approx(0.0, abs=1e-6)
    _, probe_steps = _simulate(trace, lead_in=(RequestLog([0.0], [0], [0], [64], [8]), 7.0),
                               clock=DecisionClock(6.0, 1.5, 4.0))
    assert _ups(probe_steps)[0] == pytest.approx(ups[4.0])          # the phase is the trace's, lead-in or not


def test_the_simulated_autoscaler_logs_its_windows_on_the_clock_and_the_trace_after_a_lead_in():
    clock = DecisionClock(6.0, 1.9, -12.4)
    trace = phased_trace([(20.0, 0.5), (20.0, 6.0)], 128, 24, seed=0)
    probe = phased_trace([(10.0, 1.0)], 128, 24, seed=1)
    windows: list = []
    _, steps = simulate_autoscaled(trace, COST, 4, 1024, 100_000, SETTINGS, START_S, lead_in=(probe, 14.0),
                                   clock=clock, windows=windows)
    readings = np.array([w[0] for w in windows])
    assert readings.min() < 0 < readings.max()                    # the lead-in's windows, then the trace's
    on_grid = (readings - clock.phase_s) / clock.interval_s       # whole intervals from the clock's phase
    assert np.allclose(on_grid, np.round(on_grid), atol=1e-6), readings
    assert all(decided - read == pytest.approx(clock.delay_s) for read, decided, _, _ in windows)
    busy = [w for w in windows if w[0] > 25.0]
    assert busy and all(p > 0 and d > 0 for _, _, p, d in busy)   # the busy phase's tokens were counted
    again: list = []
    simulate_autoscaled(trace, COST, 4, 1024, 100_000, SETTINGS, START_S, lead_in=(probe, 14.0), clock=clock,
                        windows=again)
    assert again == windows                                        # deterministic
    assert _scaler().windows is None                               # a fleet's scalers keep none by default


def test_windows_compare_by_reading_load_and_side_of_the_threshold():
    measured = [[0.0, 1.9, 0.4], [6.0, 7.9, 0.8], [12.0, 13.9, 0.5], [18.0, 19.9, 0.0]]
    simulated = [[0.1, 2.0, 0.5], [6.2, 8.1, 0.6], [18.4, 20.3, 0.1], [30.0, 31.9, 0.9]]
    out = compare_windows(measured, simulated, threshold=2 / 3, match_s=0.5)
    assert out["pairs"] == 3                                       # 12.0 has no simulated reading near it
    assert out["load_ratio_median"] == pytest.approx(1.0)          # 0.5 / 0.4, 0.6 / 0.8: the zero load left out
    assert out["load_mean_abs_diff"] == pytest.approx((0.1 + 0.2 + 0.1) / 3, abs=1e-3)
    assert out["same_side_of_threshold"] == pytest.approx(2 / 3, abs=1e-3)   # 0.8 over it, 0.6 under
    assert compare_windows(measured, [], 0.5) == {"pairs": 0}


def test_windows_as_loads_puts_them_on_a_clock_in_replicas():
    capacity = ReplicaCapacity(1000.0, 100.0)
    assert windows_as_loads([(105.0, 107.0, 500.0, 25.0)], capacity, origin_s=100.0) == [[5.0, 7.0, 0.75]]
