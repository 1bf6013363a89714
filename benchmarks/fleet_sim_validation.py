"""The fleet simulator against the real engine on this machine: the same open-loop trace.

1. ``kvserve profile --quick --threads 1`` on this machine (or ``--hardware PATH``: a saved entry).
2. The real engine (the default model, one thread, the profile's limits) plays a Poisson trace in
   real time; each request's TTFT and TPOT from the wall clock.
3. The simulator plays the same requests through one replica with the engine's limits and the
   profile's step times.

    .venv/bin/python benchmarks/fleet_sim_validation.py [--requests 60] [--rate 1.5] [--hardware PATH]
        [--prefix-groups G --prefix-tokens P] [--turns T --turn-gap S]

Prints one JSON object: measured and simulated TTFT p50 / p99 and TPOT p50 and their ratios
(simulated / measured); the issue's bar is within 20% (ratios in [0.8, 1.2]).

With ``--prefix-groups``, every prompt starts with one of G shared P-token prefixes
(``fleetsim/prompt_ids.py``; the same ids reach the engine and the simulator) and the simulated
replica is the engine's scheduler with its prefix cache (``SchedulerReplica(prefix_cache=True)``).
The trace is played twice on each side, prefix cache on and off: beside the ratios, the share of
prompt tokens the cache served and the cache's TTFT gain (p50 off / on), measured and simulated.

With ``--turns T`` the requests are conversations of T turns on average, played closed loop on
both sides (``fleetsim/validate.py``): a turn goes out ``--turn-gap`` seconds after the previous
one finished at the soonest, with the engine's own answer in its prompt on the engine's side; as
with shared prefixes, the trace runs with the prefix cache on and off.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def measure(trace, hw, prefix_cache: bool, replica_factory, turn_gap_s: float | None = None) -> dict:
    """``trace`` on the real engine (one thread, ``prefix_cache`` on or off) and through the
    simulator (``replica_factory`` with the engine's limits), conversations closed loop with
    ``turn_gap_s``: ``validate.compare``'s dict."""
    from kvserve import LLM
    from kvserve.fleetsim.validate import compare, run_engine_trace, simulate_trace
    from kvserve.planner.dtypes import kv_dtype, weight_dtype
    from kvserve.planner.profile import model_from_engine
    from kvserve.planner.roofline import cost_model
    llm = LLM(num_threads=1, enable_prefix_cache=prefix_cache)
    dtype = dict(hw.calibration).get("weight_dtype", "bf16")
    cm = cost_model(model_from_engine(llm.engine.model_config), hw, weight_dtype(dtype), kv_dtype(dtype), 1)
    measured = run_engine_trace(llm, trace, llm.engine.model_config.vocab_size, turn_gap_s)
    simulated = simulate_trace(trace, cm, llm.config.max_num_seqs, llm.config.max_num_batched_tokens,
                               llm.engine.kv_plan.max_tokens, replica_factory, turn_gap_s)
    return compare(measured, simulated)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=60)
    parser.add_argument("--rate", type=float, default=1.5, help="arrivals per second")
    parser.add_argument("--prompt", type=float, default=128.0)
    parser.add_argument("--output", type=float, default=24.0)
    parser.add_argument("--hardware", default=None, help="a saved hardware entry (default: profile now)")
    parser.add_argument("--prefix-groups", type=int, default=0, help="shared prefixes (0: none)")
    parser.add_argument("--prefix-tokens", type=int, default=512, help="each shared prefix's tokens")
    parser.add_argument("--turns", type=float, default=1.0, help="mean turns per conversation (1: none)")
    parser.add_argument("--turn-gap", type=float, default=2.0, help="seconds from an answer to the next turn")
    args = parser.parse_args()
    hw_path = args.hardware
    if hw_path is None:
        hw_path = os.path.join(tempfile.mkdtemp(), "local.json")
        subprocess.run([sys.executable, "-m", "kvserve.cli", "profile", "--quick", "--threads", "1", "--out",
                        hw_path], check=True, stdout=subprocess.DEVNULL)
    import functools

    from kvserve.fleetsim.replica import BatchReplica
    from kvserve.fleetsim.sched_replica import SchedulerReplica
    from kvserve.fleetsim.validate import make_trace
    from kvserve.planner.hardware import load_hardware_file
    hw = load_hardware_file(hw_path)
    trace = make_trace(args.requests, args.rate, args.prompt, args.output, prefix_groups=args.prefix_groups,
                       prefix_tokens=args.prefix_tokens, turns=args.turns, turn_gap_s=args.turn_gap)
    gap = args.turn_gap if args.turns > 1.0 else None
    result = {"requests": args.requests, "rate_per_s": args.rate, "prompt_mean": args.prompt,
              "output_mean": args.output, "profile_rms_error": dict(hw.calibration).get("rms_relative_error")}
    if not args.prefix_groups and gap is None:   # its prefix cache finds nothing in random prompts
        result.update(measure(trace, hw, True, BatchReplica))
    else:
        on = measure(trace, hw, True, functools.partial(SchedulerReplica, prefix_cache=True), gap)
        off = measure(trace, hw, False, SchedulerReplica, gap)
        result.update(turns=args.turns, turn_gap_s=gap, follow_ups=sum(p >= 0 for p in trace.parent))
        result.update(prefix_groups=args.prefix_groups, prefix_tokens=args.prefix_tokens, prefix_cache_on=on,
                      prefix_cache_off=off, cache_ttft_gain={
                          side: round(off[side]["p50_ttft_s"] / on[side]["p50_ttft_s"], 3)
                          for side in ("measured", "simulated")})
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
