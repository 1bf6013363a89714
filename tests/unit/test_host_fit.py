"""Tier 1: the in-place host fit of the simulator-vs-cluster check (``fleetsim/host_fit.py``,
``cluster_check.simulate_autoscaled``): a probe played on a known slower host (decode and
prefill slowed apart) with a known serving-path latency is fitted back to all three, and the
path latency reaches TTFT only."""
from __future__ import annotations

import numpy as np
import pytest

from kvserve.cluster.autoscaling import AutoscaleSettings
from kvserve.fleetsim.cluster_check import simulate_autoscaled
from kvserve.fleetsim.host_fit import fit_host, probe_trace, slowed
from kvserve.planner.dtypes import kv_dtype, weight_dtype
from kvserve.planner.hardware import CATALOG
from kvserve.planner.presets import preset
from kvserve.planner.roofline import cost_model

HW = CATALOG["h100-sxm"]
SETTINGS = AutoscaleSettings("tokens", "hot", 1, 2, prefill_tokens_per_s=1e6, decode_tokens_per_s=1e5,
                             demand_window_s=5.0, downscale_window_s=20.0)


def _simulate(log, slowdown: float, path_latency_s: float = 0.0, seq_extra_s: float = 0.0,
              prefill: float | None = None):
    cm = cost_model(preset("llama-3-8b"), slowed(HW, slowdown, seq_extra_s, prefill), weight_dtype("bf16"),
                    kv_dtype("bf16"), 1)
    return simulate_autoscaled(log, cm, 4, 1024, 100_000, SETTINGS, 0.0, path_latency_s)[0]


def test_slowed_divides_every_rate_and_multiplies_every_overhead():
    hw = slowed(HW, 2.0)
    assert hw.mem_bandwidth == HW.mem_bandwidth / 2 and hw.flops["bf16"] == HW.flops["bf16"] / 2
    assert hw.step_overhead_s == HW.step_overhead_s * 2 and hw.seq_overhead_s == HW.seq_overhead_s * 2
    assert slowed(HW, 1.0).mem_bandwidth == HW.mem_bandwidth
    assert slowed(HW, 2.0, 0.003).seq_overhead_s == pytest.approx(HW.seq_overhead_s * 2 + 0.003)
    apart = slowed(HW, 2.0, 0.0, 1.5)
    assert apart.flops["bf16"] == HW.flops["bf16"] / 1.5 and apart.mem_bandwidth == HW.mem_bandwidth / 2


def test_the_probe_sends_four_prompt_lengths_one_at_a_time_then_a_batch():
    probe = probe_trace(4)
    assert probe.prompt == [64, 128, 256, 384, 128, 128, 128, 128]
    assert list(probe.arrival) == [0.0, 3.0, 6.0, 9.0, 12.0, 12.0, 12.0, 12.0]


def test_the_path_latency_reaches_ttft_and_nothing_else():
    probe = probe_trace(4)
    bare, late = _simulate(probe, 1.0).arrays(), _simulate(probe, 1.0, 0.25).arrays()
    np.testing.assert_allclose(late["ttft_s"] - bare["ttft_s"], 0.25, atol=1e-9)
    np.testing.assert_allclose(late["tpot_s"], bare["tpot_s"], rtol=1e-9)
    assert late["arrival_s"].tolist() == probe.arrival       # TTFT counts from the send


def _fit(probe, measured):
    return fit_host(measured, lambda factor, seq_extra, prefill: _simulate(probe, factor, 0.0, seq_extra, prefill),
                    one_at_a_time=len(probe) - 4)


@pytest.mark.parametrize("slowdown,path,extra,prefill", [
    (1.0, 0.0, 0.0, 1.0), (1.6, 0.12, 0.0, 1.6), (3.0, 0.4, 0.0, 3.0), (1.1, 0.05, 0.002, 1.1),
    (1.0, 0.0, 0.004, 1.0), (1.0, 0.03, 0.0, 1.4), (1.3, 0.0, 0.001, 0.9)])
def test_the_fit_recovers_a_known_host(slowdown, path, extra, prefill):
    probe = probe_trace(4)
    measured = _simulate(probe, slowdown, path, extra, prefill)
    fit = _fit(probe, measured)
    assert fit.slowdown == pytest.approx(slowdown, rel=1e-3)
    assert fit.seq_extra_s == pytest.approx(extra, abs=2e-5)
    assert fit.prefill_slowdown == pytest.approx(prefill, rel=1e-2)
    assert fit.path_latency_s == pytest.approx(path, abs=1e-3)
    assert fit.fitted_batch_tpot_s == pytest.approx(fit.measured_batch_tpot_s, rel=1e-3)


@pytest.mark.parametrize("slowdown,extra", [(1.0, 0.0), (1.4, 0.003), (0.9, 0.006)])
def test_the_fit_recovers_a_known_host_from_a_stream_of_requests(slowdown, extra):
    # the busy part spread out: new prefills join the decoding batch, as in a busy trace
    probe = probe_trace(10, batch_gap_s=0.02)
    assert probe.arrival[4:6] == [12.0, 12.02]
    measured = _simulate(probe, slowdown, 0.05, extra, slowdown)
    fit = fit_host(measured, lambda f, e, p: _simulate(probe, f, 0.0, e, p), one_at_a_time=4)
    assert fit.slowdown == pytest.approx(slowdown, rel=1e-3)
    assert fit.seq_extra_s == pytest.approx(extra, abs=5e-5)
    assert fit.fitted_batch_tpot_s == pytest.approx(fit.measured_batch_tpot_s, rel=1e-3)


def test_first_tokens_earlier_than_any_path_allows_give_no_path_and_the_factor_alone():
    probe = probe_trace(4)
    measured = _simulate(probe, 1.0, 0.0, 0.0, 1.2)
    measured.first_token_s[:4] = [t - 0.0005 for t in measured.first_token_s[:4]]
    fit = _fit(probe, measured)
    assert fit.path_latency_s == 0.0 and fit.prefill_slowdown < 1.2


def test_one_prompt_length_cannot_separate_prefill_from_path():
    probe = probe_trace(4, single_prompts=(128, 128, 128, 128))
    with pytest.raises(ValueError, match="two prompt lengths"):
        _fit(probe, _simulate(probe, 1.0))


def test_a_probe_not_fully_served_is_refused():
    probe = probe_trace(2)
    measured = _simulate(probe, 1.0)
    measured.first_token_s[0] = float("nan")
    with pytest.raises(RuntimeError, match="not fully served"):
        fit_host(measured, lambda factor, extra, prefill: _simulate(probe, factor, 0.0, extra, prefill),
                 one_at_a_time=4)


def test_a_batch_cheaper_than_the_profile_says_is_fitted_on_the_batch():
    # the profile says each sequence of a step costs 3 ms more; the host's steps are 1.5x slower but
    # its sequences cost nothing extra, which only a negative extra would fit: one factor, on the batch
    import dataclasses
    profile_hw = dataclasses.replace(HW, seq_overhead_s=0.003)
    probe = probe_trace(4)

    def simulate(hw, log, factor, seq_extra=0.0, prefill=None):
        cm = cost_model(preset("llama-3-8b"), slowed(hw, factor, seq_extra, prefill), weight_dtype("bf16"),
                        kv_dtype("bf16"), 1)
        return simulate_autoscaled(log, cm, 4, 1024, 100_000, SETTINGS, 0.0, 0.0)[0]

    measured = simulate(HW, probe, 1.5)
    fit = fit_host(measured, lambda f, e, p: simulate(profile_hw, probe, f, e, p), one_at_a_time=len(probe) - 4)
    assert fit.seq_extra_s == 0.0
    assert fit.fitted_batch_tpot_s == pytest.approx(fit.measured_batch_tpot_s, rel=1e-3)
    assert fit.measured_tpot_s > fit.profile_tpot_s * fit.slowdown * 1.01      # the singles are left slower


def test_without_per_sequence_cost_one_factor_is_fitted_on_the_stream():
    # a host whose sequences cost 4 ms extra each: one factor must cover it on the batch, where the
    # singles then come out slower than measured
    probe = probe_trace(10, batch_gap_s=0.02)
    measured = _simulate(probe, 1.2, 0.05, 0.004, 1.2)
    fit = fit_host(measured, lambda f, e, p: _simulate(probe, f, 0.0, e, p), one_at_a_time=4, per_sequence=False)
    assert fit.seq_extra_s == 0.0 and fit.slowdown > 1.2
    assert fit.fitted_batch_tpot_s == pytest.approx(fit.measured_batch_tpot_s, rel=1e-3)
    assert fit.profile_tpot_s * fit.slowdown > fit.measured_tpot_s * 1.01    # the singles come out slower
    full = fit_host(measured, lambda f, e, p: _simulate(probe, f, 0.0, e, p), one_at_a_time=4)
    assert full.seq_extra_s == pytest.approx(0.004, abs=5e-5) and full.slowdown == pytest.approx(1.2, rel=1e-3)
