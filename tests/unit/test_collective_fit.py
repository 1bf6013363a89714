"""The planner's all-reduce and all-to-all links fitted to timed collectives (kvserve.parallel.collective_bench)."""
from __future__ import annotations

import dataclasses

import pytest

from kvserve.parallel.collective_bench import fit_all_to_all, fit_link
from kvserve.planner.dtypes import kv_dtype, weight_dtype
from kvserve.planner.hardware import HardwareSpec
from kvserve.planner.moe import all_to_all_s
from kvserve.planner.presets import preset
from kvserve.planner.roofline import allreduce_s, cost_model


@pytest.mark.parametrize("ranks", [2, 4])
def test_fit_recovers_latency_and_link(ranks):
    latency, link = 50e-6, 10e9
    samples = [(b, latency + 2 * (ranks - 1) / ranks * b / link) for b in (4096, 65536, 2**20, 2**22)]
    got_latency, got_link = fit_link(samples, ranks)
    assert got_latency == pytest.approx(latency, rel=1e-6)
    assert got_link == pytest.approx(link, rel=1e-6)


def test_a_negative_intercept_fits_through_the_origin():
    samples = [(1000, 1e-7), (2000, 3e-7), (4000, 7e-7)]      # least squares would cross below zero
    latency, link = fit_link(samples, 2)
    assert latency == 0.0 and link > 0


def test_the_planner_reads_the_fitted_link():
    hw = HardwareSpec(name="host", memory_bytes=24e9, mem_bandwidth=28e9, flops={"fp32": 1.6e11},
                      interconnect_bw=16e9, interconnect_latency_s=50e-6, gpus_per_node=2)
    model = preset("llama-3-8b")
    cm = cost_model(model, hw, weight_dtype("fp32"), kv_dtype("fp32"), 2)
    one = 2 * (2 - 1) / 2 * 16 * model.hidden_size * 4 / 16e9 + 50e-6
    assert allreduce_s(cm, 16) == pytest.approx((2 * model.num_layers + 1) * one)   # layers' and embedding's
    logits = 1 / 2 * 16 * model.vocab_size * 4 / 16e9 + 50e-6                       # the gather of 16 rows
    assert allreduce_s(cm, 16, num_seqs=16) == pytest.approx((2 * model.num_layers + 1) * one + logits)
    slower = cost_model(model, dataclasses.replace(hw, interconnect_bw=8e9), weight_dtype("fp32"), kv_dtype("fp32"), 2)
    assert allreduce_s(slower, 16) > allreduce_s(cm, 16)


@pytest.mark.parametrize("ranks", [2, 4])
def test_all_to_all_fit_recovers_latency_and_link(ranks):
    latency, link = 30e-6, 5e9
    samples = [(b, latency + (ranks - 1) / ranks * b / link) for b in (4096, 65536, 2**20, 2**22)]
    got_latency, got_link = fit_all_to_all(samples, ranks)
    assert got_latency == pytest.approx(latency, rel=1e-6)
    assert got_link == pytest.approx(link, rel=1e-6)


def test_the_planner_reads_the_fitted_all_to_all_and_falls_back_to_the_interconnect():
    model = preset("mixtral-8x7b")
    hw = HardwareSpec(name="host", memory_bytes=24e9, mem_bandwidth=28e9, flops={"fp32": 1.6e11},
                      interconnect_bw=16e9, interconnect_latency_s=50e-6, gpus_per_node=2)
    assert hw.all_to_all_link() == (16e9, 50e-6)
    sent, seconds = all_to_all_s(model, hw, 2, 8)
    assert seconds == pytest.approx(sent / 16e9 + 2 * 50e-6)
    fitted = dataclasses.replace(hw, all_to_all_bw=2e9, all_to_all_latency_s=0.0)
    assert fitted.all_to_all_link() == (2e9, 0.0)
    assert all_to_all_s(model, fitted, 2, 8) == pytest.approx((sent, sent / 2e9))
