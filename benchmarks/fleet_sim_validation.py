"""The fleet simulator against the real engine on this machine: the same open-loop trace.

1. ``kvserve profile --quick --threads 1`` on this machine (or ``--hardware PATH``: a saved entry).
2. The real engine (the default model, one thread, the profile's limits) plays a Poisson trace in
   real time; each request's TTFT and TPOT from the wall clock.
3. The simulator plays the same requests through one replica with the engine's limits and the
   profile's step times.

    .venv/bin/python benchmarks/fleet_sim_validation.py [--requests 60] [--rate 1.5] [--hardware PATH]

Prints one JSON object: measured and simulated TTFT p50 / p99 and TPOT p50 and their ratios
(simulated / measured); the issue's bar is within 20% (ratios in [0.8, 1.2]).
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=60)
    parser.add_argument("--rate", type=float, default=1.5, help="arrivals per second")
    parser.add_argument("--prompt", type=float, default=128.0)
    parser.add_argument("--output", type=float, default=24.0)
    parser.add_argument("--hardware", default=None, help="a saved hardware entry (default: profile now)")
    args = parser.parse_args()
    hw_path = args.hardware
    if hw_path is None:
        hw_path = os.path.join(tempfile.mkdtemp(), "local.json")
        subprocess.run([sys.executable, "-m", "kvserve.cli", "profile", "--quick", "--threads", "1", "--out",
                        hw_path], check=True, stdout=subprocess.DEVNULL)
    from kvserve import LLM
    from kvserve.fleetsim.validate import compare, make_trace, run_engine_trace, simulate_trace
    from kvserve.planner.dtypes import kv_dtype, weight_dtype
    from kvserve.planner.hardware import load_hardware_file
    from kvserve.planner.roofline import cost_model
    from kvserve.planner.profile import model_from_engine
    hw = load_hardware_file(hw_path)
    llm = LLM(num_threads=1)
    cal = dict(hw.calibration)
    cm = cost_model(model_from_engine(llm.engine.model_config), hw, weight_dtype(cal.get("weight_dtype", "bf16")),
                    kv_dtype(cal.get("weight_dtype", "bf16")), 1)
    trace = make_trace(args.requests, args.rate, args.prompt, args.output)
    measured = run_engine_trace(llm, trace, llm.engine.model_config.vocab_size)
    simulated = simulate_trace(trace, cm, llm.config.max_num_seqs, llm.config.max_num_batched_tokens,
                               llm.engine.kv_plan.max_tokens)
    result = {"requests": args.requests, "rate_per_s": args.rate, "prompt_mean": args.prompt,
              "output_mean": args.output, "profile_rms_error": cal.get("rms_relative_error"), **compare(measured, simulated)}
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
