"""The coalesced replica against the engine's scheduler where the KV pool is small enough to preempt.

One 8B model on a simulated H100, ~13 requests/s of 512-token prompts and 256-token answers for
two minutes on one always-on replica, its KV pool cut from the planner's 450k tokens to each
``--pools`` size. The same requests go through ``SchedulerReplica`` (the engine's scheduler and
block pool, one event per step: the reference) and ``BatchReplica`` (decode runs coalesced, KV
held as the engine holds it, recompute preemption of the newest admitted request).

    .venv/bin/python benchmarks/fleet_sim_preemption.py [--pools 12000,20000,30000,0]

Prints one JSON object: per pool (0: the planner's), each replica's TTFT p50 / p99, TPOT p50,
preemptions and seconds simulated in, and the ratios coalesced / scheduler.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import replace

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from kvserve.fleetsim.replica import BatchReplica  # noqa: E402
from kvserve.fleetsim.run import prepare, run_policy  # noqa: E402
from kvserve.fleetsim.scenario import ModelTraffic, Scenario  # noqa: E402
from kvserve.fleetsim.sched_replica import SchedulerReplica  # noqa: E402

SCENARIO = Scenario(name="small_pool", models=(ModelTraffic("a", "llama-3-8b", 512.0, 256.0),), peak_users=2000,
                    think_s=60, duration_s=120, zipf_s=0.5, budget_usd_month=1e6, policies=("always_on",))
KEYS = ("p50_ttft_s", "p99_ttft_s", "p50_tpot_s")


def one_run(prepared, cls) -> dict:
    """The scenario on replicas of ``cls``: its figures and the preemptions its replicas made."""
    made = []

    def factory(*args, **kwargs):
        made.append(cls(*args, **kwargs))
        return made[-1]

    started = time.perf_counter()
    report, arrays, _ = run_policy(SCENARIO, prepared, "always_on", factory)
    seconds = time.perf_counter() - started
    preempted = sum(r.preemptions_total for r in made)
    return {**{key: round(report["models"]["a"][key], 4) for key in KEYS}, "requests": int(arrays["status"].size),
            "preemptions": preempted, "simulated_in_s": round(seconds, 2)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pools", default="12000,20000,30000,0", help="KV pool sizes in tokens (0: the planner's)")
    args = parser.parse_args()
    prepared = prepare(SCENARIO)
    planned = prepared.sizings[0]
    out = {"scenario": "one llama-3-8b replica on H100, 512 + 256 tokens, 120 s",
           "planner_kv_tokens": planned.kv_tokens, "max_num_seqs": planned.max_num_seqs, "pools": {}}
    for pool in (int(p) for p in args.pools.split(",")):
        prepared.sizings[0] = replace(planned, kv_tokens=pool or planned.kv_tokens)
        real, fast = one_run(prepared, SchedulerReplica), one_run(prepared, BatchReplica)
        out["pools"][str(pool or planned.kv_tokens)] = {
            "scheduler": real, "coalesced": fast,
            "coalesced_vs_scheduler": {key: round(fast[key] / real[key], 3) for key in KEYS}}
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
