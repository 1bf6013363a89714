"""Tier 1: the host's drift over time (``fleetsim/host_meter.py``): readings of the meter's fixed
workload become the host's slowness relative to a reference span, a step function that a shared
host multiplies every simulated step by; and the meter itself, run for two seconds."""
from __future__ import annotations

import time

import numpy as np
import pytest

from kvserve.cluster.autoscaling import AutoscaleSettings
from kvserve.fleetsim.cluster_check import simulate_autoscaled
from kvserve.fleetsim.host_cpu import PlaneFit, SharedHost
from kvserve.fleetsim.host_meter import HostDrift, HostMeter
from kvserve.fleetsim.log import RequestLog
from kvserve.planner.dtypes import kv_dtype, weight_dtype
from kvserve.planner.hardware import CATALOG
from kvserve.planner.presets import preset
from kvserve.planner.roofline import cost_model


def test_the_drift_is_each_reading_over_the_reference_spans_median_smoothed():
    readings = [(100.0 + i, cpu) for i, cpu in enumerate([0.02, 0.02, 0.02, 0.04, 0.04, 0.04, 0.03, 0.01])]
    drift = HostDrift.from_readings(readings, reference=(100.0, 102.0), origin=100.0)
    assert drift.times == (0.0, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0)
    assert drift.factors == pytest.approx((1.0, 1.0, 1.0, 2.0, 2.0, 2.0, 1.5, 1.5))   # a running median of 3
    assert drift.at(-5.0) == 1.0 and drift.at(3.5) == 2.0 and drift.at(100.0) == 1.5
    assert drift.shifted(3.0).at(0.5) == 2.0
    assert drift.summary() == {"readings": 8, "min": 1.0, "median": 1.5, "max": 2.0}


def test_the_median_over_spans_reads_only_the_readings_inside_them():
    drift = HostDrift((0.0, 1.0, 2.0, 3.0, 4.0), (1.0, 0.9, 0.8, 1.3, 0.85))
    assert drift.median_over([(1.0, 3.0), (4.0, 5.0)]) == (pytest.approx(0.85), 3)      # 0.9, 0.8, 0.85
    assert drift.median_over([(10.0, 20.0)]) is None and drift.median_over([]) is None
    step = HostDrift.step(0.9, from_s=20.0)                 # the probe played at its own speed, then the trace
    assert step.at(-3.0) == 1.0 and step.at(19.9) == 1.0 and step.at(20.0) == 0.9 and step.at(1e6) == 0.9
    assert HostDrift.step(1.1).at(0.0) == 1.1


def test_a_reading_spike_alone_is_smoothed_away_and_an_empty_reference_reads_the_whole_series():
    drift = HostDrift.from_readings([(0.0, 1.0), (1.0, 5.0), (2.0, 1.0)], reference=(50.0, 60.0))
    assert drift.factors == pytest.approx((1.0, 1.0, 1.0))
    assert HostDrift.from_readings([], reference=(0.0, 1.0)).at(3.0) == 1.0


def test_a_shared_host_multiplies_its_cores_factor_by_the_drift_at_the_steps_start():
    host = SharedHost(1, 1, PlaneFit(0.0, 0.0), drift=HostDrift((0.0, 10.0), (1.0, 1.5)))
    host.busy("a", 10.0)
    host.busy("b", 10.0)                                 # two one-thread engines on one core
    assert host.step_factor(5.0) == pytest.approx(2.0)
    assert host.step_factor(12.0) == pytest.approx(3.0)
    assert SharedHost(1, 1, PlaneFit(0.0, 0.0)).step_factor(12.0) == 1.0


def test_simulated_steps_after_the_host_slows_take_longer_by_its_drift():
    cost = cost_model(preset("llama-3-8b"), CATALOG["h100-sxm"], weight_dtype("bf16"), kv_dtype("bf16"), 1)
    settings = AutoscaleSettings("tokens", "hot", 1, 1, prefill_tokens_per_s=1e6, decode_tokens_per_s=1e5,
                                 demand_window_s=5.0, downscale_window_s=20.0)
    trace = RequestLog([1.0, 20.0], [0, 0], [0, 0], [128, 128], [64, 64])
    host = SharedHost(2, 1, PlaneFit(0.0, 0.0), drift=HostDrift((0.0, 10.0), (1.0, 1.8)))
    tpot = simulate_autoscaled(trace, cost, 4, 1024, 100_000, settings, 0.0, host=host)[0].arrays()["tpot_s"]
    assert tpot[1] / tpot[0] == pytest.approx(1.8, rel=1e-6)


def test_the_meter_reads_its_workloads_cpu_seconds_about_every_interval():
    started = time.perf_counter()
    with HostMeter(every_s=0.2, passes=2) as meter:
        time.sleep(2.0)
    times = np.array([t for t, _ in meter.readings])
    assert len(times) >= 4 and all(cpu > 0 for _, cpu in meter.readings)
    assert started < times[0] and times[-1] < time.perf_counter()        # the caller's clock
    assert np.all(np.diff(times) >= 0.2)
