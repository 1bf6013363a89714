"""Tier 1: the fleet simulator's parts: re-tiering with hysteresis, the coalesced replica against
the engine's real scheduler, one request's arithmetic, scale from zero, determinism, the CLI."""
from __future__ import annotations

import json
import math
from dataclasses import replace

import pytest

from kvserve.autoscale.residency import RetierConfig, retier
from kvserve.autoscale.tiers import ResidencyTier as T
from kvserve.fleetsim.log import DONE, REJECTED, RequestLog
from kvserve.fleetsim.run import prepare, run_policy
from kvserve.fleetsim.scenario import ModelTraffic, Scenario, capstone
from kvserve.fleetsim.sched_replica import SchedulerReplica
from kvserve.planner.roofline import StepWork, chunk_attention, step_time

TWO_MODELS = Scenario(name="two", models=(ModelTraffic("a", "llama-3-8b"),
                                          ModelTraffic("b", "llama-3-70b", 2048, 64, "code")),
                      peak_users=2000, think_s=60, duration_s=240, zipf_s=0.5, budget_usd_month=1e6)


def test_retier_promotes_on_load_keeps_hot_until_the_lower_threshold_and_bounds_the_host_cache():
    planned = {"a": T.HOT, "b": T.COLD, "c": T.COLD, "d": T.COLD}
    weights = {"a": 16e9, "b": 16e9, "c": 16e9, "d": 16e9}
    config = RetierConfig(promote_load=0.5, demote_load=0.2, host_cache_bytes=20e9)
    load = {"a": 0.0, "b": 0.6, "c": 0.1, "d": 0.05}
    now = retier({}, planned, load, weights, config)
    assert now == {"a": T.HOT, "b": T.HOT, "c": T.WARM, "d": T.COLD}     # one 16 GB model fits 20 GB
    hovering = retier(now, planned, {**load, "b": 0.3}, weights, config)
    assert hovering["b"] is T.HOT                                          # 0.3 >= demote: stays
    assert retier(hovering, planned, {**load, "b": 0.1}, weights, config)["b"] is T.WARM
    assert retier({}, planned, {**load, "b": 0.3}, weights, config)["b"] is T.WARM   # never promoted at 0.3


def test_the_coalesced_replica_matches_the_engine_scheduler_within_20_percent():
    """The same trace through BatchReplica (decode runs coalesced) and SchedulerReplica (the
    engine's Scheduler, one event per step): TTFT p50 / p99 and TPOT p50 per model within 20%."""
    prepared = prepare(TWO_MODELS)
    fast, _, _ = run_policy(TWO_MODELS, prepared, "always_on")
    real, arrays, _ = run_policy(TWO_MODELS, prepared, "always_on", SchedulerReplica)
    assert (arrays["status"] == DONE).all() and arrays["status"].size > 1000
    for name in ("a", "b"):
        for key in ("p50_ttft_s", "p99_ttft_s", "p50_tpot_s"):
            assert fast["models"][name][key] == pytest.approx(real["models"][name][key], rel=0.2), (name, key)


def _one_request_log(prompt: int, output: int, at: float = 1.0) -> RequestLog:
    return RequestLog([at], [0], [0], [prompt], [output])


def test_one_request_on_an_idle_replica_is_one_prefill_step_then_decode_steps():
    scenario = replace(TWO_MODELS, models=TWO_MODELS.models[:1], duration_s=60)
    prepared = prepare(scenario)
    cm = prepared.sizings[0].cost
    report, arrays, _ = run_policy(scenario, prepared, "always_on", log=_one_request_log(512, 65))
    prefill = step_time(cm, StepWork(512, 1, (chunk_attention(0, 512),))).total_s
    assert arrays["ttft_s"][0] == pytest.approx(prefill)
    mid = 512 + 1 + 63 / 2                                   # the run's mean context
    decode = step_time(cm, StepWork(1, 1, ((mid, mid),))).total_s
    assert arrays["tpot_s"][0] == pytest.approx(decode)


def test_a_model_with_no_replica_queues_its_request_for_a_start_or_rejects_it_past_the_wait():
    scenario = replace(TWO_MODELS, models=TWO_MODELS.models[:1], duration_s=300)
    prepared = prepare(scenario)
    start = prepared.sizings[0].cold_start.start_s(weights_in_host_memory=False)
    _, arrays, sim = run_policy(scenario, prepared, "scale_to_zero", log=_one_request_log(256, 8, at=5.0))
    assert arrays["waited_for_start"][0] and sim.deployments[0].starts == 1
    assert start < arrays["ttft_s"][0] < start + 1.0
    short = replace(scenario, max_queue_wait_s=start / 2)
    _, arrays, _ = run_policy(short, prepare(short), "scale_to_zero", log=_one_request_log(256, 8, at=5.0))
    assert arrays["status"][0] == REJECTED


def test_same_seed_same_day_and_every_request_answered():
    scenario = replace(capstone(), duration_s=3 * 3600, peak_users=600)
    prepared = prepare(scenario)
    first, a1, _ = run_policy(scenario, prepared, "tiers_tokens")
    again, a2, _ = run_policy(scenario, prepared, "tiers_tokens")
    assert json.dumps(first, sort_keys=True) == json.dumps(again, sort_keys=True)
    assert set(a1["status"].tolist()) <= {DONE, REJECTED}
    other, a3, _ = run_policy(replace(scenario, seed=1), prepared, "tiers_tokens")
    assert a3["status"].size != a1["status"].size or other != first


def test_the_command_prints_each_policys_attainment_cost_and_p99(capsys):
    from kvserve.cli import main
    assert main(["simulate", "--scenario", "capstone", "--hours", "1", "--policies", "always_on,tiers_tokens",
                 "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["budget_usd_month"] == capstone().budget_usd_month and out["models"] == 40
    for name in ("always_on", "tiers_tokens"):
        policy = out["policies"][name]
        assert 0 <= policy["slo_attainment"] <= 1 and policy["cost_usd_month"] > 0
        assert math.isfinite(policy["p99_ttft_s"])


def test_the_example_scenario_file_runs(capsys):
    from kvserve.cli import main
    assert main(["simulate", "--scenario", "examples/fleet_scenario.json", "--policies", "tiers_tokens"]) == 0
    out = capsys.readouterr().out
    assert "example: 6 models on h100-sxm" in out and "tiers_tokens" in out
