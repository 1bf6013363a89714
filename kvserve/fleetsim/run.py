"""``simulate(scenario)``: size every model with the planner, plan the residency tiers for the
budget (``kvserve plan --fleet``'s ``plan_fleet``), draw the day's requests once, and run each
policy over the same requests; one JSON-ready dict with ``budget_usd_month`` and, under
``policies``, each policy's ``slo_attainment``, ``cost_usd_month`` and ``p99_ttft_s``."""
from __future__ import annotations

import copy
from dataclasses import dataclass

import numpy as np

from kvserve.autoscale.fleet_plan import FleetModel, FleetQuestion, plan_fleet
from kvserve.autoscale.tiers import ResidencyTier
from kvserve.fleetsim.fleet import FleetSim
from kvserve.fleetsim.replica import BatchReplica
from kvserve.fleetsim.report import policy_report
from kvserve.fleetsim.scenario import Scenario
from kvserve.fleetsim.sizing import ReplicaSizing, size_replica
from kvserve.fleetsim.traffic import draw_requests, model_rates
from kvserve.planner.hardware import resolve_hardware


@dataclass
class Prepared:
    """What every policy shares: the hardware, each model's replica, traffic figures, the plan."""

    hw: object
    sizings: list[ReplicaSizing]
    mean_rps: list[float]
    peak_rps: list[float]
    initial_rps: list[float]
    planned: dict[str, ResidencyTier]
    plan_cost_usd_month: float


def prepare(scenario: Scenario) -> Prepared:
    """Size each model (one planner call per distinct preset and shape) and plan the tiers."""
    hw = resolve_hardware(scenario.gpu)
    t = np.arange(0.0, scenario.duration_s, scenario.bin_s) + scenario.bin_s / 2
    rates = model_rates(scenario, t)
    mean, peak, first = rates.mean(axis=1), rates.max(axis=1), rates[:, 0]
    cache: dict[tuple, ReplicaSizing] = {}
    sizings = []
    for m in scenario.models:
        key = (m.preset, m.mean_prompt_len, m.output_tokens)
        if key not in cache:
            cache[key] = size_replica(m.name, m.preset, hw, 1.0, m.mean_prompt_len, m.output_tokens,
                                      scenario.ttft_slo_s, scenario.tpot_slo_s)
        sizings.append(copy.copy(cache[key]))
        object.__setattr__(sizings[-1], "model", m.name)
    question = FleetQuestion(
        tuple(FleetModel(m.name, m.preset, float(mean[i]), float(peak[i] / max(mean[i], 1e-12)),
                         m.mean_prompt_len, m.output_tokens) for i, m in enumerate(scenario.models)),
        hw, scenario.budget_usd_month, ttft_p99_s=scenario.ttft_slo_s, tpot_s=scenario.tpot_slo_s,
        headroom=scenario.headroom, scale_down_window_s=scenario.downscale_window_s,
        host_cache_bytes=scenario.host_cache_bytes)
    plan = plan_fleet(question)
    return Prepared(hw, sizings, list(mean), list(peak), list(first), {p.name: p.tier for p in plan.models},
                    plan.cost_usd_month)


def run_policy(scenario: Scenario, prepared: Prepared, policy: str, replica_factory=BatchReplica,
               log=None, router: str = "least_loaded") -> tuple[dict, dict, FleetSim]:
    """One policy over the scenario's requests, placed by ``router``: (report, the log's arrays,
    the finished simulation)."""
    log = log if log is not None else draw_requests(scenario)
    sim = FleetSim(scenario, policy, prepared.sizings, log, prepared.planned, prepared.peak_rps,
                   prepared.initial_rps, replica_factory, router=router)
    record = sim.run()
    arrays = log.arrays()
    report = policy_report(scenario, arrays, record, sim.deployments, prepared.hw.price_per_hour)
    report["timeline"] = [[round(t, 1), gpus] for t, gpus in record["timeline"]]
    return report, arrays, sim


def simulate(scenario: Scenario, policies: tuple[str, ...] | None = None, replica_factory=BatchReplica,
             router: str = "least_loaded") -> tuple[dict, dict]:
    """Every policy of the scenario, each deployment's requests placed by ``router`` on replicas
    made by ``replica_factory``: (the JSON-ready result, each policy's log arrays for plots)."""
    prepared = prepare(scenario)
    requests = draw_requests(scenario)
    results, arrays = {}, {}
    for policy in policies or scenario.policies:
        results[policy], arrays[policy], _ = run_policy(scenario, prepared, policy, replica_factory,
                                                        requests.fresh(), router)
    out = {"scenario": scenario.name, "gpu": prepared.hw.name, "price_per_gpu_hour": prepared.hw.price_per_hour,
           "budget_usd_month": scenario.budget_usd_month, "ttft_slo_s": scenario.ttft_slo_s,
           "models": len(scenario.models), "peak_users": scenario.peak_users, "seed": scenario.seed,
           "router": router,
           "duration_h": scenario.duration_s / 3600, "requests": int(next(iter(arrays.values()))["status"].size),
           "planned_tiers": {t.value: sum(1 for v in prepared.planned.values() if v is t) for t in ResidencyTier},
           "plan_cost_usd_month": round(prepared.plan_cost_usd_month, 2), "notes": list(scenario.notes),
           "policies": results}
    return out, arrays
