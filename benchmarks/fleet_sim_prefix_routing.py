"""Shared prefixes in the fleet simulator: what the router's policy does to the prefix caches.

The scenario ``examples/fleet_prefix_scenario.json`` (one 8B model on simulated H100s, 20
requests/s, each prompt one of 256 shared 4,096-token prefixes then 256 tokens of its own; the
planner's replicas, always on) is played by replicas that run the engine's scheduler with its
prefix cache (``SchedulerReplica(prefix_cache=True)``), once per router policy, and once with
the cache off (the baseline). The same requests every time. Each run is played again by the
coalesced replica with its prefix cache kept per group (``PrefixCachingReplica``; ``BatchReplica``
with the cache off): its figures, its ratios to the scheduler replica's and how much faster it ran
are under ``coalesced`` / ``coalesced_vs_scheduler``.

    .venv/bin/python benchmarks/fleet_sim_prefix_routing.py [--scenario PATH]

Prints one JSON object: per run, the share of prompt tokens the caches served, TTFT p50 / p99,
TPOT p50, the GPU-hours, TTFT p50 relative to the cache-off baseline, and the coalesced replica's
figures beside the scheduler replica's.
"""
from __future__ import annotations

import argparse
import functools
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCENARIO = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples",
                        "fleet_prefix_scenario.json")
RUNS = (("cache_off", False, "least_loaded"), ("least_loaded", True, "least_loaded"),
        ("round_robin", True, "round_robin"), ("prefix_approx", True, "prefix_approx"),
        ("kv_aware", True, "kv_aware"))


def _figures(scenario, factory, router: str) -> dict:
    """One always-on run of ``scenario`` with replicas from ``factory`` behind ``router``."""
    from kvserve.fleetsim.run import simulate
    t = time.perf_counter()
    result, _ = simulate(scenario, ("always_on",), factory, router)
    p = result["policies"]["always_on"]
    return {"requests": result["requests"], "cached_prompt_share": p["cached_prompt_share"],
            "p50_ttft_s": p["p50_ttft_s"], "p99_ttft_s": p["p99_ttft_s"], "p50_tpot_s": p["p50_tpot_s"],
            "gpu_hours": round(sum(p["gpu_hours"].values()), 3), "simulated_in_s": round(time.perf_counter() - t, 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scenario", default=SCENARIO)
    args = parser.parse_args()
    from kvserve.fleetsim.cached_replica import PrefixCachingReplica
    from kvserve.fleetsim.cli import load_scenario
    from kvserve.fleetsim.replica import BatchReplica
    from kvserve.fleetsim.sched_replica import SchedulerReplica
    scenario = load_scenario(args.scenario)
    out = {"scenario": scenario.name, "models": [m.name for m in scenario.models], "runs": {}}
    for name, cache, router in RUNS:
        run = {"router": router, "prefix_cache": cache,
               **_figures(scenario, functools.partial(SchedulerReplica, prefix_cache=cache), router)}
        fast = _figures(scenario, PrefixCachingReplica if cache else BatchReplica, router)
        run["coalesced"] = fast
        run["coalesced_vs_scheduler"] = {key: round(fast[key] / run[key], 3) if run[key] else None
                                         for key in ("cached_prompt_share", "p50_ttft_s", "p99_ttft_s",
                                                     "p50_tpot_s", "simulated_in_s")}
        out["runs"][name] = run
    base = out["runs"]["cache_off"]["p50_ttft_s"]
    for run in out["runs"].values():
        run["p50_ttft_vs_cache_off"] = round(run["p50_ttft_s"] / base, 3)
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
