"""What a simulated day shows: TTFT / TPOT percentiles per policy, class and model, SLO
attainment (served within the TTFT SLO, over all requests: a rejected request is a miss),
GPU-hours per residency tier, dollars a month (GPU-hours x the GPU's price x 730 h / the
simulated hours) and the share of prompt tokens the replicas' prefix caches served."""
from __future__ import annotations

import numpy as np

from kvserve.autoscale.fleet_plan import HOURS_PER_MONTH
from kvserve.fleetsim.log import DONE, REJECTED
from kvserve.fleetsim.scenario import CLASSES, HOUR, Scenario



def _pct(values: np.ndarray, q: float) -> float | None:
    values = values[~np.isnan(values)]
    return round(float(np.percentile(values, q)), 4) if values.size else None


def _latency(arr: dict, mask: np.ndarray, slo_s: float) -> dict:
    ttft, tpot = arr["ttft_s"][mask], arr["tpot_s"][mask]
    served = arr["status"][mask] == DONE
    within = served & (np.nan_to_num(ttft, nan=np.inf) <= slo_s)
    return {"requests": int(mask.sum()), "slo_attainment": round(float(within.mean()), 6) if mask.any() else None,
            "p50_ttft_s": _pct(ttft, 50), "p99_ttft_s": _pct(ttft, 99),
            "p50_tpot_s": _pct(tpot, 50), "p99_tpot_s": _pct(tpot, 99)}


def policy_report(scenario: Scenario, arr: dict, record: dict, deployments, price_per_hour: float) -> dict:
    """One policy's figures (the module docstring)."""
    everyone = np.ones(arr["status"].shape, bool)
    out = _latency(arr, everyone, scenario.ttft_slo_s)
    if scenario.doubling is not None:
        d = scenario.doubling
        window = (arr["arrival_s"] >= d.start_s) & (arr["arrival_s"] < d.end_s)
        out["doubling"] = _latency(arr, window, scenario.ttft_slo_s)
    gpu_hours = {tier: 0.0 for tier in ("hot", "warm", "cold")}
    for dep in deployments:
        for tier, seconds in dep.gpu_seconds.items():
            gpu_hours[tier] += seconds / HOUR
    total_hours = sum(gpu_hours.values())
    month = HOURS_PER_MONTH * HOUR / scenario.duration_s
    out.update({
        "cost_usd_month": round(total_hours * price_per_hour * month, 2),
        "within_budget": bool(total_hours * price_per_hour * month <= scenario.budget_usd_month),
        "gpu_hours": {k: round(v, 2) for k, v in gpu_hours.items()},
        "replica_starts": sum(d.starts for d in deployments),
        "rejected": int((arr["status"] == REJECTED).sum()),
        "waited_for_a_start": int(arr["waited_for_start"].sum()),
        "cached_prompt_share": round(float(arr["cached_tokens"].sum() / max(1, arr["prompt"].sum())), 4),
        "classes": {c: _latency(arr, arr["klass"] == i, scenario.ttft_slo_s) for i, c in enumerate(CLASSES)},
        "models": {m.name: {**_latency(arr, arr["model"] == i, scenario.ttft_slo_s),
                            "tier_at_end": deployments[i].tier.value, "starts": deployments[i].starts}
                   for i, m in enumerate(scenario.models)},
    })
    return out
