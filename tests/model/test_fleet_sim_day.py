"""Tier 2 (no model weights, but a simulated day each): the capstone's goal and the simulator's speed.

- Capstone (40 models on simulated H100s, budget $79,000/month, TTFT SLO 2 s): residency tiers +
  token-based autoscaling serve >= 99% of requests within the SLO inside the budget, where scale
  to zero misses the SLO and always-on exceeds the budget.
- Speed: 50 models, 10,000 concurrent users, 24 hours in under 2 minutes on this machine.
"""
from __future__ import annotations

import time

from kvserve.fleetsim.run import simulate
from kvserve.fleetsim.scenario import capstone, speed


def test_capstone_tiers_with_token_autoscaling_meet_the_slo_within_the_budget():
    result, _ = simulate(capstone())
    p = result["policies"]
    budget = result["budget_usd_month"]
    assert p["tiers_tokens"]["slo_attainment"] >= 0.99 and p["tiers_tokens"]["cost_usd_month"] <= budget
    assert p["scale_to_zero"]["slo_attainment"] < 0.99
    assert p["always_on"]["cost_usd_month"] > budget
    assert p["tiers_tokens"]["slo_attainment"] >= p["tiers_requests"]["slo_attainment"] - 1e-3   # averaged counts: alike here
    assert p["tiers_tokens"]["replica_starts"] < p["scale_to_zero"]["replica_starts"]


def test_a_day_of_50_models_and_10000_users_simulates_in_under_two_minutes():
    scenario = speed()
    assert len(scenario.models) == 50 and scenario.peak_users == 10_000 and scenario.duration_s == 24 * 3600
    t = time.perf_counter()
    result, arrays = simulate(scenario)
    elapsed = time.perf_counter() - t
    assert result["requests"] > 1_000_000 and (arrays["tiers_tokens"]["status"] > 0).all()
    assert elapsed < 120, f"{elapsed:.1f} s"
