"""Tier 2 (no model weights, but a simulated day each): the capstone's goal and the simulator's speed.

- Capstone (40 models on simulated H100s, budget $79,000/month, TTFT SLO 2 s): residency tiers +
  token-based autoscaling serve >= 99% of requests within the SLO inside the budget, where scale
  to zero misses the SLO and always-on exceeds the budget.
- Speed: 50 models, 10,000 concurrent users, 24 hours in under 2 minutes on this machine.
- Long prompts (``long_prompts``: every other model 6,144-token prompts, 32-token answers), four
  hours around the peak: the request-count signal under-provisions the long-prefill models and
  misses the p99 TTFT SLO, the token signal keeps it.
"""
from __future__ import annotations

import time

from dataclasses import replace

from kvserve.fleetsim.run import simulate
from kvserve.fleetsim.scenario import HOUR, capstone, long_prompts, speed


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


def test_on_long_prompts_token_autoscaling_keeps_the_slo_that_request_counts_miss():
    scenario = replace(long_prompts(), duration_s=4 * HOUR, peak_hour=2.0, doubling=None, spikes=())
    p = simulate(scenario)[0]["policies"]
    slo = scenario.ttft_slo_s
    assert p["tiers_requests"]["p99_ttft_s"] > slo >= p["tiers_tokens"]["p99_ttft_s"], p
    assert p["tiers_tokens"]["slo_attainment"] >= 0.99 > p["tiers_requests"]["slo_attainment"], p
    assert p["tiers_tokens"]["cost_usd_month"] > p["tiers_requests"]["cost_usd_month"]      # it pays for the prefill
