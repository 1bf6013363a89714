"""Tier 1: the fleet question (``kvserve plan --fleet``): tiers from load and the budget, the
cost and attainment arithmetic, the host-cache bound, the JSON and the command."""
from __future__ import annotations

import dataclasses
import json
import math

import pytest

from kvserve.autoscale.fleet_plan import HOURS_PER_MONTH, FleetModel, FleetQuestion, plan_fleet, question_from_json
from kvserve.planner.hardware import CATALOG

H100 = CATALOG["h100-sxm"]
BUSY = FleetModel("busy", "llama-3-8b", rps=20.0)
RARE = FleetModel("rare", "llama-2-7b", rps=0.0005, prompt_tokens=512, output_tokens=128)
QUIET = FleetModel("quiet", "llama-2-7b", rps=0.05, prompt_tokens=512, output_tokens=256)


def plan(budget: float, *models: FleetModel, **constants):
    return plan_fleet(FleetQuestion(models or (BUSY, RARE, QUIET), H100, budget, **constants))


def by_name(p):
    return {m.name: m for m in p.models}


def test_the_cheapest_layout_keeps_busy_models_hot_and_scales_the_rest_to_zero():
    p = by_name(plan(3_000))
    assert p["busy"].tier.value == "hot" and p["busy"].load_mean >= 0.5
    assert p["rare"].tier.value == "warm" and p["quiet"].tier.value == "warm"
    # the rare model idles past the window before most requests: exp(-0.0005 x 300) of them wait a start
    assert p["rare"].cold_start_share == pytest.approx(math.exp(-0.0005 * 300))
    assert p["rare"].slo_attainment == pytest.approx(1 - math.exp(-0.0005 * 300))     # start 15.5 s > 2 s SLO


def test_a_larger_budget_buys_hot_residency_for_the_models_that_miss_most_per_dollar():
    tight, loose = plan(4_500), plan(60_000)
    assert by_name(loose)["rare"].tier.value == "hot" and by_name(tight)["rare"].tier.value == "warm"
    assert loose.slo_attainment > 0.999999 > tight.slo_attainment    # quiet: 3e-7 of its requests wait
    assert by_name(loose)["quiet"].tier.value == "warm"        # fewer than one wait a month: not worth it
    assert loose.cost_usd_month <= 60_000 and tight.within_budget
    assert any("rare: warm -> hot" in note for note in loose.notes)


def test_over_budget_is_said_not_hidden():
    p = plan(100.0)
    assert not p.within_budget and any("over budget" in note for note in p.notes)


def test_warm_cost_is_a_whole_replica_while_up_plus_starts_times_start():
    """A model that is up holds a whole replica however light its load: up (1 - exp(-rps x W)) of
    the month, plus the GPU time of its starts (the fleet simulator showed busy time alone under-counting)."""
    q = FleetQuestion((QUIET, RARE), H100, 1.0)          # no budget for promotions: both warm
    for m, traffic in zip(plan_fleet(q).models, (QUIET, RARE)):
        down = math.exp(-traffic.rps * q.scale_down_window_s)
        starts = traffic.rps * HOURS_PER_MONTH * 3600 * down
        busy = m.load_mean * q.headroom * m.tp * HOURS_PER_MONTH
        hours = max(busy, (1 - down) * m.tp * HOURS_PER_MONTH) + starts * m.start_s * m.tp / 3600
        assert m.gpu_hours_month == pytest.approx(hours) and m.cost_usd_month == pytest.approx(hours * H100.price_per_hour)
    assert by_name(plan_fleet(q))["quiet"].gpu_hours_month > 0.99 * HOURS_PER_MONTH     # up nearly all month


def test_no_room_in_the_host_cache_means_cold_with_the_storage_read_in_its_start():
    warm = by_name(plan(3_000))["quiet"]
    cold = by_name(plan(3_000, host_cache_bytes=0))["quiet"]
    assert cold.tier.value == "cold" and cold.start_s == pytest.approx(warm.start_s + warm.weight_bytes / 2e9)


def test_json_and_the_command(capsys):
    from kvserve.planner.cli import main
    with open("examples/fleet.json") as f:
        raw = json.load(f)
    q = question_from_json(raw, H100, 6_000)
    assert q.budget_usd_month == 6_000 and len(q.models) == 5 and q.ttft_p99_s == raw["ttft_p99_s"]
    out = plan_fleet(q).to_json()
    assert {"budget_usd_month", "cost_usd_month", "within_budget", "slo_attainment", "models"} <= set(out)
    assert {"name", "tier", "tp", "replicas_peak", "cost_usd_month", "slo_attainment"} <= set(out["models"][0])
    assert main(["plan", "--fleet", "examples/fleet.json", "--budget", "6000", "--json"]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed["budget_usd_month"] == 6000 and len(printed["models"]) == 5
    bad = dataclasses.replace(q, models=(FleetModel("x", "no-such-model", 1.0),))
    with pytest.raises(Exception, match="no-such-model"):
        plan_fleet(bad)
