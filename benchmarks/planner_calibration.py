"""Planner calibration: predicted vs measured kvserve output tokens/s on this machine.

Prerequisite: ``kvserve profile`` (saves ``~/.cache/kvserve/hardware/local.json``; its efficiency
factors and host overheads are fitted to kvserve's own timed runs, never to this benchmark).

Workloads, run through kvserve's offline API in one process:
  * engine-core benchmark: 64 requests, prompt lengths uniform 16-1024, output lengths uniform
    16-256 (random.Random(0), the same draw as benchmarks/offline_throughput.py), greedy,
    ignore_eos, all at once;
  * a single request: prompt 128, output 128.

The prediction replays kvserve's scheduler (token budget, max_num_seqs) through the planner's
roofline with the profiled hardware entry. Measured = best of ``--repeats`` timings (load from
other processes only ever slows a run) on the profile's clock: with one engine thread that is
the process's CPU time, so time the OS hands to other jobs on a shared machine is not counted;
wall-clock figures are reported alongside. Prints JSON: predicted, measured, error for each.

    .venv/bin/python benchmarks/planner_calibration.py [--hardware PATH] [--threads N]
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import random
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))


def engine_core_lengths(num_requests: int = 64, seed: int = 0) -> list[tuple[int, int]]:
    """(prompt, output) lengths drawn like the engine-core benchmark (fallback when its script
    is absent: its text-offset draws are skipped, so individual lengths may differ)."""
    rng = random.Random(seed)
    return [(rng.randint(16, 1024), rng.randint(16, 256)) for _ in range(num_requests)]


def engine_core_requests(tokenizer, num_requests: int, seed: int):
    """The engine-core benchmark's own workload when benchmarks/offline_throughput.py is present."""
    path = os.path.join(HERE, "offline_throughput.py")
    if os.path.exists(path):
        spec = importlib.util.spec_from_file_location("offline_throughput", path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module.make_workload(tokenizer, num_requests, seed)
    rng = random.Random(seed)
    return [([rng.randrange(100, 40000) for _ in range(p)], o) for p, o in engine_core_lengths(num_requests, seed)]


def timed_generate(llm, requests) -> dict:
    """Wall and process-CPU seconds and output tokens of one ``generate`` call, from an empty
    prefix cache (a repeat, or a prompt sharing a prefix with an earlier one, must not skip its
    prefill)."""
    from kvserve import SamplingParams

    reset = getattr(llm.engine, "reset_prefix_cache", None)
    if reset is not None:
        reset()
    prompts = [list(p) for p, _ in requests]
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for _, n in requests]
    wall, cpu = time.perf_counter(), time.process_time()
    outs = llm.generate(prompts, params)
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    produced = sum(len(o.outputs[0].token_ids) for o in outs)
    assert produced == sum(n for _, n in requests), "ignore_eos run produced the wrong token count"
    return {"wall": wall, "cpu": cpu, "tokens": produced}


def compare(predicted_s: float, best: dict, clock: str) -> dict:
    """Predicted vs measured output tokens/s on the profile's clock (and wall time alongside)."""
    tokens = best["tokens"]
    out = {"clock": clock, "predicted_output_tokens_per_s": round(tokens / predicted_s, 3),
           "measured_output_tokens_per_s": round(tokens / best[clock], 3),
           "error": round(best[clock] / predicted_s - 1, 4),
           "predicted_s": round(predicted_s, 3), "measured_s": round(best[clock], 3),
           "measured_wall_s": round(best["wall"], 3), "measured_cpu_s": round(best["cpu"], 3),
           "measured_wall_output_tokens_per_s": round(tokens / best["wall"], 3)}
    out["wall_error"] = round(best["wall"] / predicted_s - 1, 4)
    return out


def parse_args(argv):
    from kvserve.planner.hardware import default_hardware_dir

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hardware", default=os.path.join(default_hardware_dir(), "local.json"))
    parser.add_argument("--threads", type=int, help="engine threads (default: the profile's)")
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--clock", choices=("wall", "cpu"), help="default: the profile's clock")
    parser.add_argument("--repeats", type=int, default=2,
                        help="best of N timings (the single request: best of max(N, 3))")
    return parser.parse_args(argv)


def fitted_summary(hw) -> dict:
    return {"mem_efficiency": hw.mem_efficiency, "gemv_efficiency": hw.gemv_efficiency,
            "flops_efficiency": hw.flops_efficiency, "kv_efficiency": hw.kv_efficiency,
            "step_overhead_ms": round(hw.step_overhead_s * 1e3, 3),
            "seq_overhead_ms": round(hw.seq_overhead_s * 1e3, 4),
            "request_overhead_ms": round(hw.request_overhead_s * 1e3, 3),
            "profile_rms_error": dict(hw.calibration).get("rms_relative_error")}


def main(argv=None) -> int:
    from kvserve.planner.dtypes import kv_dtype, weight_dtype
    from kvserve.planner.hardware import resolve_hardware
    from kvserve.planner.profile import model_from_engine
    from kvserve.planner.roofline import cost_model
    from kvserve.planner.simulate import SchedulerLimits, predict_run

    args = parse_args(argv)
    hw = resolve_hardware(path=args.hardware)
    cal = dict(hw.calibration)
    threads = args.threads or cal.get("threads") or None
    import torch
    from kvserve import LLM

    if threads:
        torch.set_num_threads(threads)
    llm = LLM(model=None, **({"num_threads": threads} if threads else {}))
    model = model_from_engine(llm.engine.model_config)
    dtype = {"torch.float32": "fp32", "torch.bfloat16": "bf16", "torch.float16": "fp16"}[str(llm.engine.dtype)]
    cm = cost_model(model, hw, weight_dtype(dtype), kv_dtype(dtype), 1)
    limits = SchedulerLimits(llm.config.max_num_seqs, llm.config.max_num_batched_tokens, llm.config.block_size)

    batch = engine_core_requests(llm.tokenizer, args.requests, args.seed)
    single = [(batch[0][0][:128], 128)]
    timed_generate(llm, [(batch[1][0][:32], 4)])                       # warm-up
    shapes = {f"engine_core_{args.requests}": batch, "single_request_128_128": single}
    result = {"hardware": hw.name, "hardware_file": args.hardware, "threads": threads,
              "load_average_1m_at_start": round(os.getloadavg()[0], 2), "fitted": fitted_summary(hw)}
    clock = args.clock or cal.get("clock", "wall")
    for name, reqs in shapes.items():
        lengths = [(len(p), n) for p, n in reqs]
        pred = predict_run(cm, lengths, limits)
        repeats = max(args.repeats, 3) if len(reqs) == 1 else args.repeats
        best = min((timed_generate(llm, reqs) for _ in range(max(1, repeats))), key=lambda m: m[clock])
        result[name] = dict(compare(pred["seconds"], best, clock), prompt_tokens=sum(p for p, _ in lengths),
                            output_tokens=best["tokens"], steps_predicted=pred["steps"])
    result["load_average_1m_at_end"] = round(os.getloadavg()[0], 2)
    result["preemptions"] = llm.engine.scheduler.num_preemptions
    engine_limits = {"max_num_seqs": limits.max_num_seqs, "max_num_batched_tokens": limits.max_num_batched_tokens,
                     "block_size": limits.block_size}
    if any(cal.get(k) not in (None, v) for k, v in engine_limits.items()):
        result["warning"] = f"engine limits {engine_limits} differ from the profiled ones; re-run kvserve profile"
    result["within_20_percent"] = all(abs(result[n]["error"]) <= 0.20 for n in shapes)
    json.dump(result, sys.stdout, indent=2)
    print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
