"""``kvserve simulate``: the fleet simulator on a named or file scenario (docs/fleet_simulator.md)."""
from __future__ import annotations

import argparse
import functools
import json
from dataclasses import replace

from kvserve.router.policies import POLICIES


def register(subparsers) -> None:
    p = subparsers.add_parser("simulate", help="simulate a fleet of models for a day: router, autoscaling, "
                                               "residency tiers, cold starts; SLO attainment and cost per policy")
    p.add_argument("--scenario", default="capstone", help="capstone, speed, or a scenario JSON file")
    p.add_argument("--policies", default=None, help="comma-separated: always_on, scale_to_zero, tiers_requests, "
                                                    "tiers_tokens (default: the scenario's)")
    p.add_argument("--hours", type=float, default=None, help="simulate only the first H hours")
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--plot", default=None, metavar="PNG", help="write the day's plot here")
    p.add_argument("--json", action="store_true", help="print one JSON object (without per-model detail)")
    p.add_argument("--per-model", action="store_true", help="keep per-model figures and the timeline in the JSON")
    p.add_argument("--replica", choices=("batch", "scheduler"), default="batch",
                   help="batch: decode runs coalesced (a day in seconds); scheduler: the engine's scheduler, "
                        "one event per step (~100x slower: short traces)")
    p.add_argument("--prefix-cache", action="store_true",
                   help="the replicas keep a prefix cache: the engine's own with --replica scheduler, "
                        "one kept per prefix group with the batch replica (cached_replica.py)")
    p.add_argument("--router", default="least_loaded", choices=POLICIES,
                   help="the router's policy (kv_aware: fed the replicas' cache events; default least_loaded)")
    p.set_defaults(func=run)


def load_scenario(name: str):
    """A built-in scenario by name, or one from a JSON file."""
    from kvserve.fleetsim.scenario import SCENARIOS, from_json
    if name in SCENARIOS:
        return SCENARIOS[name]()
    with open(name) as f:
        return from_json(json.load(f))


def replica_factory(args: argparse.Namespace):
    """The simulated replica ``--replica`` / ``--prefix-cache`` name."""
    from kvserve.fleetsim.cached_replica import PrefixCachingReplica
    from kvserve.fleetsim.replica import BatchReplica
    from kvserve.fleetsim.sched_replica import SchedulerReplica
    if args.replica == "batch":
        return PrefixCachingReplica if args.prefix_cache else BatchReplica
    return functools.partial(SchedulerReplica, prefix_cache=args.prefix_cache)


def run(args: argparse.Namespace) -> int:
    from kvserve.fleetsim.run import simulate
    scenario = load_scenario(args.scenario)
    if args.hours is not None:
        scenario = replace(scenario, duration_s=args.hours * 3600)
    if args.seed is not None:
        scenario = replace(scenario, seed=args.seed)
    policies = tuple(args.policies.split(",")) if args.policies else None
    result, arrays = simulate(scenario, policies, replica_factory(args), args.router)
    if args.plot:
        from kvserve.fleetsim.plots import plot_day
        plot_day(result, arrays, args.plot)
    if not args.per_model:
        for policy in result["policies"].values():
            policy.pop("models", None)
            policy.pop("timeline", None)
    if args.json:
        print(json.dumps(result))
        return 0
    print(f"{result['scenario']}: {result['models']} models on {result['gpu']}, {result['requests']:,} requests, "
          f"TTFT SLO {result['ttft_slo_s']} s, budget ${result['budget_usd_month']:,.0f}/month")
    print(f"{'policy':<16}{'within SLO':>11}{'p99 TTFT':>10}{'p99 doubling':>14}{'$/month':>10}{'starts':>8}")
    for name, p in result["policies"].items():
        doubling = p.get("doubling", {}).get("p99_ttft_s")
        print(f"{name:<16}{p['slo_attainment']:>11.4%}{p['p99_ttft_s']:>10.3f}"
              f"{doubling if doubling is not None else float('nan'):>14.3f}{p['cost_usd_month']:>10,.0f}"
              f"{p['replica_starts']:>8}")
    return 0
