"""Tier 1: the planner's disaggregated layout (``kvserve plan --disaggregate``): instance counts
follow the demand and the SLOs, the KV transfer follows the bytes and the link, the break-even is
where the stall equals the transfer, the JSON has the documented keys. Pure, no engine."""
from __future__ import annotations

import dataclasses
import json

import pytest

from kvserve.planner.candidates import PlanInputs, PlanOptions
from kvserve.planner.cli import main
from kvserve.planner.disagg import DisaggOptions, make_disagg_plan
from kvserve.planner.disagg_kv import (breakeven_prompt_tokens, kv_transfer_bytes, kv_transfer_s, stall_s,
                                       transfer_seconds)
from kvserve.planner.dtypes import kv_dtype, weight_dtype
from kvserve.planner.hardware import CATALOG
from kvserve.planner.presets import preset
from kvserve.planner.workload import LengthDist, Workload

DISAGG_KEYS = {"prefill_tp", "prefill_instances", "prefill_capacity_tokens_per_s", "disagg_ttft_p99_ms",
               "decode_tp", "decode_instances", "decode_batch_per_instance", "decode_tpot_ms",
               "decode_capacity_tokens_per_s", "kv_transfer_bytes_per_request", "kv_transfer_ms_per_request",
               "kv_import_ms_per_request", "disagg_breakeven_prompt_tokens", "unified_gpus", "disagg_gpus",
               "unified_usd_per_month", "disagg_usd_per_month", "unified_tpot_p99_burst_ms",
               "disagg_tpot_p99_burst_ms", "tpot_p99_burst_ratio"}


def inputs(rps=20.0, prompt="4096", output="256", ttft_ms=1000.0, tpot_ms=30.0, tp=None, gpu="h100-sxm",
           model="llama-3-8b") -> PlanInputs:
    w = Workload(prompt=LengthDist.parse(prompt, "prompt_tokens"), output=LengthDist.parse(output, "output_tokens"),
                 rps=rps, ttft_p99_s=ttft_ms / 1e3, tpot_s=tpot_ms / 1e3)
    return PlanInputs(preset(model), CATALOG[gpu], weight_dtype("bf16"), kv_dtype("bf16"), w,
                      options=PlanOptions(tp=tp))


def value(plan, name: str) -> float:
    return plan.figure(name).value


def test_prefill_instances_follow_prefill_demand():
    one = make_disagg_plan(inputs(rps=100, tp=1))
    two = make_disagg_plan(inputs(rps=200, tp=1))
    n1, n2 = value(one, "prefill_instances"), value(two, "prefill_instances")
    assert n1 >= 5
    assert 1.75 <= n2 / n1 <= 2.25
    assert value(two, "decode_instances") > value(one, "decode_instances")


def test_a_tighter_ttft_slo_raises_prefill_instances():
    loose = make_disagg_plan(inputs(rps=100, ttft_ms=1000, tp=1))
    tight = make_disagg_plan(inputs(rps=100, ttft_ms=250, tp=1))
    assert value(tight, "prefill_instances") > value(loose, "prefill_instances")
    assert value(tight, "prefill_utilisation") < value(loose, "prefill_utilisation")
    assert value(tight, "disagg_ttft_p99_ms") <= 250
    free_loose = make_disagg_plan(inputs(rps=100, ttft_ms=1000))
    free_tight = make_disagg_plan(inputs(rps=100, ttft_ms=250))
    assert free_tight.prefill.gpus >= free_loose.prefill.gpus


def test_a_tighter_tpot_slo_raises_decode_instances():
    loose = make_disagg_plan(inputs(rps=100, tpot_ms=30, tp=1))
    tight = make_disagg_plan(inputs(rps=100, tpot_ms=12, tp=1))
    assert value(tight, "decode_batch_per_instance") < value(loose, "decode_batch_per_instance")
    assert value(tight, "decode_instances") > value(loose, "decode_instances")
    assert value(tight, "decode_tpot_ms") <= 12


def test_transfer_scales_with_prompt_length_and_link_bandwidth():
    model, kv = preset("llama-3-8b"), kv_dtype("bf16")
    b4 = kv_transfer_bytes(model, kv, 4096, 16).value
    assert b4 == 4096 * 131_072                          # 2 x 32 x 8 x 128 x 2 B per token
    assert kv_transfer_bytes(model, kv, 4100, 16).value == b4     # only full blocks move
    t = lambda n, bw: kv_transfer_s(kv_transfer_bytes(model, kv, n, 16).value, 1, bw, 0.0).value
    assert t(8192, 100e9) == pytest.approx(2 * t(4096, 100e9))
    assert t(4096, 50e9) == pytest.approx(2 * t(4096, 100e9))
    assert t(4096, 100e9) == pytest.approx(4096 * 131_072 / 100e9 * 1e3)
    assert kv_transfer_s(0, 1, 100e9, 1e-5).value == 0.0          # no full block, nothing moves
    fast = make_disagg_plan(inputs(tp=1), DisaggOptions(link_bw=100e9))
    slow = make_disagg_plan(inputs(tp=1), DisaggOptions(link_bw=25e9))
    lat = CATALOG["h100-sxm"].interconnect_latency_s * 1e3
    ratio = (value(slow, "kv_transfer_ms_per_request") - lat) / (value(fast, "kv_transfer_ms_per_request") - lat)
    assert ratio == pytest.approx(4.0)
    longer = make_disagg_plan(inputs(prompt="8192", tp=1), DisaggOptions(link_bw=100e9))
    assert value(longer, "kv_transfer_bytes_per_request") == 2 * value(fast, "kv_transfer_bytes_per_request")


def test_cross_node_transfer_uses_50_gbs():
    plan = make_disagg_plan(inputs(model="llama-3-70b", tp=8, rps=5))
    assert plan.prefill.link_bw == 50e9                   # TP 8 + TP 8 > 8 GPUs per node
    assert "cross-node" in plan.figure("kv_transfer_ms_per_request").arithmetic
    same = make_disagg_plan(inputs(tp=1))
    assert same.prefill.link_bw == CATALOG["h100-sxm"].interconnect_bw


def test_breakeven_search_finds_where_stall_equals_transfer():
    assert breakeven_prompt_tokens(lambda n: 3.0 * n, lambda n: 2.0 * n + 100, 16, 100_000) == 100
    assert breakeven_prompt_tokens(lambda n: 5.0 * n, lambda n: 1.0, 16, 1000) == 16
    assert breakeven_prompt_tokens(lambda n: 1.0 * n, lambda n: 2.0 * n, 16, 1000) is None


def test_plan_breakeven_is_where_the_stall_crosses_the_transfer():
    inp = inputs(tp=1)
    plan = make_disagg_plan(inp, DisaggOptions(link_bw=1e9))
    n = int(value(plan, "disagg_breakeven_prompt_tokens"))
    c = plan.unified.chosen
    ctx = 4096 + 256 / 2
    stall = lambda k: stall_s(c.cm, c.batch, ctx, k, inp.options.max_batched_tokens)
    transfer = lambda k: transfer_seconds(inp.model, inp.kv_dtype, k, 16, 1, 1e9, inp.hw.interconnect_latency_s)
    assert 16 < n < 4096
    assert stall(n) >= transfer(n) and stall(n - 1) < transfer(n - 1)
    faster = make_disagg_plan(inp, DisaggOptions(link_bw=0.25e9))
    assert value(faster, "disagg_breakeven_prompt_tokens") > n      # a slower link moves it up


def test_bursts_hurt_unified_streams_more_than_disaggregated_ones():
    plan = make_disagg_plan(inputs(tp=1))
    u, d = value(plan, "unified_tpot_p99_burst_ms"), value(plan, "disagg_tpot_p99_burst_ms")
    assert u > value(plan.unified, "tpot_ms") and d >= value(plan, "decode_tpot_ms")
    assert d < 0.5 * u
    assert value(plan, "tpot_p99_burst_ratio") == pytest.approx(d / u)
    gpus = plan.prefill.tp * value(plan, "prefill_instances") + plan.decode.tp * value(plan, "decode_instances")
    assert value(plan, "disagg_gpus") == gpus
    assert value(plan, "unified_gpus") == value(plan.unified, "gpus")


def test_every_figure_has_its_arithmetic():
    plan = make_disagg_plan(inputs())
    assert all(f.arithmetic and "=" in f.arithmetic for f in plan.figures)


def test_json_has_the_documented_keys(capsys):
    code = main(["plan", "--model", "llama-3-8b", "--gpu", "h100-sxm", "--rps", "20", "--prompt-tokens", "4096",
                 "--output-tokens", "256", "--ttft-p99-ms", "1000", "--tpot-ms", "30", "--disaggregate", "--json"])
    out = json.loads(capsys.readouterr().out)
    assert code == 0
    assert {"tp", "gpus", "usd_per_month", "tpot_ms"} <= set(out)        # the unified plan, unchanged
    d = out["disaggregation"]
    assert DISAGG_KEYS <= set(d)
    assert DISAGG_KEYS <= set(d["arithmetic"]) and all(d["arithmetic"][k] for k in DISAGG_KEYS)
    assert d["unified_gpus"] == out["gpus"]
    assert {"prefill_by_tp", "decode_by_tp", "slo_violations", "notes"} <= set(d)
    assert all(row["tp"] <= 8 for row in d["prefill_by_tp"])


def test_disaggregate_needs_traffic_mode(capsys):
    code = main(["plan", "--model", "llama-3-8b", "--context", "4096", "--concurrency", "8", "--disaggregate",
                 "--json"])
    assert code == 2
    assert "traffic mode" in json.loads(capsys.readouterr().out)["error"]["message"]


def test_table_shows_the_disaggregated_sections(capsys):
    assert main(["plan", "--model", "llama-3-8b", "--gpu", "h100-sxm", "--rps", "20", "--prompt-tokens", "4096",
                 "--output-tokens", "256", "--ttft-p99-ms", "1000", "--tpot-ms", "30", "--disaggregate"]) == 0
    text = capsys.readouterr().out
    for title in ("Disaggregated: prefill instances", "Disaggregated: KV transfer", "Unified vs disaggregated",
                  "Memory by TP degree", "<- prefill + decode"):
        assert title in text


def test_unmeetable_ttft_is_reported_not_hidden():
    plan = make_disagg_plan(inputs(ttft_ms=50, tp=1))
    assert plan.prefill.violations and any("TTFT" in n for n in plan.notes)
    assert plan.to_json()["disaggregation"]["slo_violations"]


def test_moe_plan_shows_expert_parallel_degree(capsys):
    base = ["plan", "--model", "mixtral-8x7b", "--gpu", "h100-sxm", "--context", "4096", "--concurrency", "64",
            "--json"]
    assert main(base) == 0
    plain = json.loads(capsys.readouterr().out)
    assert main(base + ["--expert-parallel"]) == 0
    ep = json.loads(capsys.readouterr().out)
    assert plain["ep"] == ep["ep"] == plain["tp"] == 2
    assert "--expert-parallel:" in ep["arithmetic"]["ep"] and "comparison" in plain["arithmetic"]["ep"]
    assert main(["plan", "--model", "llama-3-8b", "--json"]) == 0
    assert "ep" not in json.loads(capsys.readouterr().out)                 # dense: no EP figure


def test_link_override_must_be_positive():
    with pytest.raises(Exception, match="kv-link-gbs"):
        make_disagg_plan(inputs(), DisaggOptions(link_bw=0.0))
    assert dataclasses.replace(DisaggOptions(), link_bw=1e9).link_bw == 1e9
