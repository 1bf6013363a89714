"""The simulator's shared-prefix routing against the local Ray cluster's: least-loaded and
KV-aware routing over two fixed replicas, the same trace.

For each router: ``kvserve cluster serve --replicas 2 --router R`` (the default model, one thread
and 0.25 GiB of KV each: the trace's prefixes need more than one replica's pool, less than two),
a probe through it (``host_fit.probe_trace``: requests one at a time, then a batch of four at
once, not the autoscaling check's stream: ten requests spread over two replicas fit a decode
slowdown of 0.21-0.54; no shared prefix) fits the host against the profile as the autoscaling
check does (``benchmarks/fleet_sim_cluster.py``), then a Poisson trace whose prompts start with one of G
shared P-token prefixes is replayed (prompt ids from ``fleetsim/prompt_ids.py``; each request's
cached tokens from the stream's usage). The simulator plays the same requests through two
replicas running the engine's scheduler and prefix cache, placed by the same router policy (fed
their cache events) on the replicas' stats as the cluster's router saw them (every
``ROUTING_STATS_PERIOD_S``, as old as the ingress measured; ``router_view_live``: the router
sees the replicas as they are), on the fitted host (``cluster_check.simulate_fixed``).

    .venv/bin/python benchmarks/fleet_sim_cluster_prefix.py [--hardware PATH] [--requests 120]
        [--rate 1.0] [--prefix-groups 32] [--prefix-tokens 512] [--turns 1] [--turn-gap 2.0]

With ``--turns T`` (> 1) the trace is conversations of T turns on average, played closed loop on
both sides (``replay.replay_trace(turn_gap_s=)``: a later turn is sent ``--turn-gap`` seconds
after its previous answer ended, carrying the ids the cluster answered with;
``cluster_check.simulate_fixed(turn_gap_s=)``): where each conversation's history is cached is
then up to the router.

Prints one JSON object: per router, measured and simulated share of prompt tokens served from
cache, TTFT p50 / p99 and TPOT p50 with their ratios (simulated / measured), the host fit; and
the KV-aware router's TTFT p50 gain over least-loaded, measured and simulated.
"""
from __future__ import annotations

import argparse
import asyncio
import functools
import json
import os
import sys
from collections import Counter

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.cluster_run import IDLE_S, IDLE_WINDOWS  # noqa: E402
from benchmarks.fleet_sim_cluster import KV_CACHE_GIB, host_cores, profile  # noqa: E402
from kvserve.fleetsim.cluster_sim import ClusterSimulator  # noqa: E402
from kvserve.fleetsim.cluster_reads import mean_stats_age, router_stats  # noqa: E402
from benchmarks.server_process import ServerProcess  # noqa: E402

REPLICAS, MAX_NUM_SEQS = 2, 4
ROUTERS = ("least_loaded", "kv_aware")


def cluster_flags(router: str) -> list[str]:
    """``kvserve cluster serve`` options of one run (the simulator reads the same ones)."""
    return ["--threads", "1", "--kv-cache-gib", str(KV_CACHE_GIB), "--max-num-seqs", str(MAX_NUM_SEQS),
            "--replicas", str(REPLICAS), "--router", router, "--no-ladder"]


def run_router(router: str, hw_path: str, trace, turn_gap_s: float | None = None) -> dict:
    """The probe and the trace on the cluster with ``router``, the fit, the simulation, the
    comparison."""
    from kvserve.cli import build_parser
    from kvserve.cluster.admission import fleet_slots
    from kvserve.fleetsim.cluster_check import simulate_fixed
    from kvserve.fleetsim.host_cpu import PlaneFit, SharedHost, idle_readings, read_cpu
    from kvserve.fleetsim.host_fit import fit_host, probe_trace
    from kvserve.fleetsim.log import REJECTED
    from kvserve.fleetsim.replay import replay_trace
    from kvserve.fleetsim.validate import compare
    flags = cluster_flags(router)
    args = build_parser().parse_args(["cluster", "serve", *flags])
    costs = ClusterSimulator(hw_path, args, None, None)     # its cost(): the profile slowed by a fit
    slots = fleet_slots(REPLICAS, MAX_NUM_SEQS, args.queue_wait_s)

    def simulate(log, slowdown, seq_extra_s=0.0, prefill_slowdown=None, path_latency_s=0.0, host=None, stats=None):
        cm = costs.cost(slowdown, seq_extra_s, prefill_slowdown)
        kv_tokens = int(KV_CACHE_GIB * 2**30 / cm.kv_bytes_per_token)
        return simulate_fixed(log, cm, MAX_NUM_SEQS, args.max_num_batched_tokens, kv_tokens, REPLICAS, router,
                              path_latency_s, host, True, slots, args.queue_wait_s, turn_gap_s, stats)

    probe, vocab = probe_trace(MAX_NUM_SEQS), costs.cost(1.0).model.vocab_size
    with ServerProcess(*flags, command=("cluster", "serve"), startup_timeout_s=420) as cluster:
        idle = idle_readings(IDLE_S, IDLE_WINDOWS)
        probed, _ = asyncio.run(replay_trace(cluster.url, probe, vocab, seed=1))
        plane = PlaneFit.measure(idle, read_cpu(), sum(probe.output))
        measured, served_by = asyncio.run(replay_trace(cluster.url, trace, vocab, seed=0, turn_gap_s=turn_gap_s))
        stats_age_s = mean_stats_age(cluster.url)
    fit = fit_host(probed, lambda factor, extra, prefill: simulate(probe, factor, extra, prefill),
                   one_at_a_time=len(probe) - MAX_NUM_SEQS)
    on_fit = functools.partial(simulate, trace, fit.slowdown, fit.seq_extra_s, fit.prefill_slowdown,
                               fit.path_latency_s, SharedHost(host_cores(), args.threads, plane))
    stats = router_stats(stats_age_s)
    simulated = on_fit(stats=stats)
    live = compare(measured, on_fit())
    return {**compare(measured, simulated), "host_fit": fit.as_dict(), "plane_fit": plane.as_dict(),
            "router_stats": {"period_s": stats[0], "mean_age_s": round(stats_age_s, 4), "delay_s": round(stats[1], 4)},
            "router_view_live": {"ratio": live["ratio"]},
            "not_served": {"measured": measured.status.count(REJECTED), "simulated": simulated.status.count(REJECTED)},
            "measured_requests_per_replica": dict(Counter(map(str, served_by)))}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hardware", default=None, help="a saved hardware entry (default: profile now)")
    parser.add_argument("--requests", type=int, default=120)
    parser.add_argument("--rate", type=float, default=1.0, help="arrivals per second")
    parser.add_argument("--prefix-groups", type=int, default=32)
    parser.add_argument("--prefix-tokens", type=int, default=512)
    parser.add_argument("--prompt-mean", type=float, default=64.0, help="a request's own prompt tokens, mean")
    parser.add_argument("--output-mean", type=float, default=16.0)
    parser.add_argument("--turns", type=float, default=1.0, help="> 1: conversations, closed loop")
    parser.add_argument("--turn-gap", type=float, default=2.0, help="seconds from an answer to the next turn")
    args = parser.parse_args()
    from kvserve.fleetsim.validate import make_trace
    hw_path = args.hardware or profile()
    conversations = args.turns > 1.0
    trace = make_trace(args.requests, args.rate, args.prompt_mean, args.output_mean, prefix_groups=args.prefix_groups,
                       prefix_tokens=args.prefix_tokens, turns=args.turns, turn_gap_s=args.turn_gap)
    gap = args.turn_gap if conversations else None
    result = {"requests": args.requests, "rate_per_s": args.rate, "prefix_groups": args.prefix_groups,
              "prefix_tokens": args.prefix_tokens, "prompt_mean": args.prompt_mean, "output_mean": args.output_mean,
              "turns": args.turns, "turn_gap_s": gap, "later_turns": sum(p >= 0 for p in trace.parent),
              "replicas": REPLICAS, "kv_cache_gib": KV_CACHE_GIB,
              "routers": {router: run_router(router, hw_path, trace, gap) for router in ROUTERS}}
    spread, aware = (result["routers"][r] for r in ROUTERS)
    result["kv_aware_ttft_p50_gain"] = {side: round(spread[side]["p50_ttft_s"] / aware[side]["p50_ttft_s"], 3)
                                        for side in ("measured", "simulated")}
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
