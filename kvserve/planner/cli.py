"""``kvserve plan`` and ``kvserve profile``: argparse wiring only; the work is in pure functions."""
from __future__ import annotations

import argparse
import json
import sys

from kvserve.errors import KVServeError
from kvserve.planner.errors import PlannerInputError

PLAN_EPILOG = """examples:
  kvserve plan --model llama-3-70b --gpu h100-sxm --context 8192 --concurrency 32
  kvserve plan --model deepseek-v3 --gpu h200 --weight-dtype fp8 --context 32768 --concurrency 64 --json
  kvserve plan --model llama-3-8b --gpu l4 --rps 20 --prompt-tokens 1000:4000 --output-tokens 200 \\
      --ttft-p99-ms 1000 --tpot-ms 50 --spec-alpha 0.7 --spec-k 4
  kvserve plan --model llama-3-8b --gpu h100-sxm --rps 20 --prompt-tokens 4096 --output-tokens 256 \\
      --ttft-p99-ms 1000 --tpot-ms 30 --disaggregate
  kvserve plan --model default --gpu local --weight-dtype fp32 --kv-dtype fp32 --context 512 --concurrency 64
"""


def _add_plan_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("model and hardware")
    g.add_argument("--model", default="llama-3-8b",
                   help="preset name, 'default' (the default GGUF), a config.json (or its folder) or a .gguf")
    g.add_argument("--gpu", default="h100-sxm", help="catalog name, 'local' (profiled), or a JSON file")
    g.add_argument("--gpu-file", help="hardware JSON (from `kvserve profile` or hand-written)")
    g.add_argument("--price-per-hour", type=float, help="override the $/GPU-hour")
    g.add_argument("--memory-gib", type=float, help="custom figure: memory per GPU (GiB)")
    g.add_argument("--bandwidth-gbs", type=float, help="custom figure: memory bandwidth (GB/s)")
    g.add_argument("--tflops", type=float, help="custom figure: dense TFLOP/s for the weight dtype's compute")
    g.add_argument("--weight-dtype", default="auto",
                   help="bf16, fp16, fp32, fp8, int8, int4, auto (a profiled entry's: what its engine ran; else native)")
    g.add_argument("--kv-dtype", default="auto",
                   help="bf16, fp16, fp32, fp8 (= fp8_e4m3), fp8_e5m2, int8 (8-bit: + 4 B scale per token and kv head), "
                        "auto (a profiled entry's: what its engine ran; else bf16)")
    w = p.add_argument_group("workload")
    w.add_argument("--context", type=int, default=4096, help="tokens per sequence (context mode)")
    w.add_argument("--concurrency", type=int, default=1, help="concurrent sequences (context mode)")
    w.add_argument("--rps", type=float, help="requests/s: switches to traffic mode")
    w.add_argument("--prompt-tokens", help="N, LO-HI (uniform) or MEAN:P99")
    w.add_argument("--output-tokens", help="N, LO-HI (uniform) or MEAN:P99")
    w.add_argument("--peak-to-mean", type=float, default=1.0)
    w.add_argument("--headroom", type=float, default=0.2, help="spare capacity kept at peak (0-1)")
    w.add_argument("--ttft-p99-ms", type=float)
    w.add_argument("--tpot-ms", type=float)
    s = p.add_argument_group("speculative decoding, MoE, engine")
    s.add_argument("--spec-alpha", type=float, help="draft token acceptance rate")
    s.add_argument("--spec-k", type=int, default=4, help="drafted tokens per step")
    s.add_argument("--spec-draft-cost", type=float, default=0.05, help="draft forward / target step")
    s.add_argument("--expert-parallel", action="store_true", help="spread MoE experts across the TP group")
    s.add_argument("--tp", type=int, help="force this tensor-parallel degree")
    s.add_argument("--disaggregate", action="store_true",
                   help="also size a prefill/decode disaggregated layout and compare it (traffic mode)")
    s.add_argument("--kv-link-gbs", type=float,
                   help="with --disaggregate: KV transfer link GB/s per rank (default: the interconnect, "
                        "50 GB/s across nodes)")
    s.add_argument("--fleet", metavar="FILE",
                   help="the fleet question: models and traffic in a JSON file (examples/fleet.json); prints "
                        "each model's tier, replicas, cost and SLO attainment against --budget")
    s.add_argument("--budget", type=float, help="with --fleet: $ per month (default: the file's budget_usd_month)")
    s.add_argument("--max-tp", type=int, default=64)
    s.add_argument("--max-num-seqs", type=int,
                   help="engine limit (default 256, or the profiled engine's for a profiled entry)")
    s.add_argument("--max-batched-tokens", type=int, help="tokens per step (default 8192, or the profiled engine's)")
    s.add_argument("--block-size", type=int, help="KV block tokens (default 16, or the profiled engine's)")
    s.add_argument("--claimed-tokens-per-s", type=float,
                   help="refuse if this output tokens/s per GPU is above the roofline")
    o = p.add_argument_group("output")
    o.add_argument("--json", action="store_true", help="machine-readable JSON")
    o.add_argument("--plot", metavar="DIR", help="write planner_memory.png and planner_roofline.png to DIR")


def custom_figures(hw, args: argparse.Namespace):
    """The hardware entry with any --memory-gib / --bandwidth-gbs / --tflops replaced."""
    import dataclasses
    from types import MappingProxyType

    changes = {}
    if args.memory_gib is not None:
        changes["memory_bytes"] = args.memory_gib * 2**30
    if args.bandwidth_gbs is not None:
        changes["mem_bandwidth"] = args.bandwidth_gbs * 1e9
    if args.tflops is not None:
        from kvserve.planner.dtypes import weight_dtype
        key = "bf16" if args.weight_dtype == "auto" else weight_dtype(args.weight_dtype).compute
        changes["flops"] = MappingProxyType({**hw.flops, key: args.tflops * 1e12})
    if not changes:
        return hw
    return dataclasses.replace(hw, name=f"{hw.name} (custom)", **changes)


def build_inputs(args: argparse.Namespace):
    """PlanInputs from parsed flags (pure apart from reading the model / hardware files)."""
    from kvserve.planner.candidates import PlanInputs, PlanOptions
    from kvserve.planner.dtypes import kv_dtype, weight_dtype
    from kvserve.planner.hardware import resolve_hardware
    from kvserve.planner.model_io import resolve_model
    from kvserve.planner.workload import LengthDist, SpecConfig, Workload

    model = resolve_model(args.model)
    hw = custom_figures(resolve_hardware(args.gpu, args.gpu_file, args.price_per_hour), args)
    cal = dict(hw.calibration)            # a profiled entry knows its engine's limits and dtypes
    wd = planned_weight_dtype(args.weight_dtype, model, cal)
    workload = Workload(
        context=args.context, concurrency=args.concurrency,
        prompt=LengthDist.parse(args.prompt_tokens, "prompt_tokens") if args.prompt_tokens else None,
        output=LengthDist.parse(args.output_tokens, "output_tokens") if args.output_tokens else None,
        rps=args.rps, peak_to_mean=args.peak_to_mean, headroom=args.headroom,
        ttft_p99_s=args.ttft_p99_ms / 1e3 if args.ttft_p99_ms is not None else None,
        tpot_s=args.tpot_ms / 1e3 if args.tpot_ms is not None else None)
    spec = (SpecConfig(args.spec_alpha, args.spec_k, args.spec_draft_cost)
            if args.spec_alpha is not None else None)

    def limit(flag, key: str, default: int) -> int:
        return int(flag if flag is not None else cal.get(key, default))

    options = PlanOptions(block_size=limit(args.block_size, "block_size", 16),
                          max_num_seqs=limit(args.max_num_seqs, "max_num_seqs", 256),
                          max_batched_tokens=limit(args.max_batched_tokens, "max_num_batched_tokens", 8192),
                          max_tp=args.max_tp, tp=args.tp,
                          expert_parallel=args.expert_parallel,
                          claimed_tokens_per_s_per_gpu=args.claimed_tokens_per_s)
    kv = args.kv_dtype if args.kv_dtype != "auto" else cal.get("kv_cache_dtype") or "bf16"
    return PlanInputs(model, hw, wd, kv_dtype(kv), workload, spec, options)


def planned_weight_dtype(name: str, model, calibration: dict):
    """The weight dtype to plan with: ``name``; for ``auto`` on a profiled entry the one its
    engine ran (``calibration["weight_dtype"]``: a CPU engine computes in fp32 where the CPU
    lacks native bf16, whatever the checkpoint holds), else the checkpoint's own (None for a
    GGUF file: its exact tensor bytes)."""
    from kvserve.planner.dtypes import weight_dtype
    if name != "auto":
        return weight_dtype(name)
    if calibration.get("weight_dtype"):
        return weight_dtype(calibration["weight_dtype"])
    return None if model.native_weight_bytes else weight_dtype(model.native_dtype)


def _fail(exc: KVServeError, as_json: bool) -> int:
    if as_json:
        print(json.dumps(exc.to_dict(), indent=2))
    else:
        print(f"kvserve plan: error: {exc.message}", file=sys.stderr)
    return 2


def run_plan(args: argparse.Namespace) -> int:
    """``kvserve plan``: print the table (or JSON); optionally write the plots."""
    from kvserve.planner.plan import make_plan
    from kvserve.planner.report import render_table

    if getattr(args, "disaggregate", False):
        return _run_disagg_plan(args)
    if getattr(args, "fleet", None):
        return _run_fleet_plan(args)
    try:
        plan = make_plan(build_inputs(args))
    except KVServeError as exc:
        return _fail(exc, args.json)
    if args.plot:
        from kvserve.planner.plots import write_plots
        paths = write_plots(plan, args.plot)
        if not args.json:
            print("plots: " + ", ".join(paths), file=sys.stderr)
    print(json.dumps(plan.to_json(), indent=2) if args.json else render_table(plan))
    return 0


def _run_fleet_plan(args: argparse.Namespace) -> int:
    """``kvserve plan --fleet FILE``: tiers, replicas and cost per model (table or JSON)."""
    from kvserve.autoscale.fleet_plan import plan_fleet, question_from_json
    from kvserve.planner.hardware import resolve_hardware
    try:
        with open(args.fleet, encoding="utf-8") as f:
            raw = json.load(f)
        plan = plan_fleet(question_from_json(raw, resolve_hardware(args.gpu, args.gpu_file, args.price_per_hour),
                                             args.budget))
    except (OSError, ValueError, KeyError, TypeError) as exc:
        return _fail(PlannerInputError(f"--fleet {args.fleet}: {exc}", param="fleet"), args.json)
    except KVServeError as exc:
        return _fail(exc, args.json)
    if args.json:
        print(json.dumps(plan.to_json(), indent=2))
        return 0
    print(f"kvserve plan --fleet: {len(plan.models)} models, ${plan.cost_usd_month:,.0f} a month of "
          f"${plan.budget_usd_month:,.0f} ({'within' if plan.within_budget else 'OVER'} budget), "
          f"{plan.slo_attainment:.4%} of requests within the TTFT SLO")
    print(f"  {'model':<16} {'tier':<5} {'TP':>3} {'load':>7} {'peak repl.':>10} {'start s':>8} "
          f"{'cold-start share':>17} {'$/month':>10}")
    for m in plan.models:
        print(f"  {m.name:<16} {m.tier.value:<5} {m.tp:>3} {m.load_mean:>7.3f} {m.replicas_peak:>10} "
              f"{m.start_s:>8.1f} {m.cold_start_share:>17.3g} {m.cost_usd_month:>10,.0f}")
    for note in plan.notes:
        print(f"  - {note}")
    return 0


def _run_disagg_plan(args: argparse.Namespace) -> int:
    """``kvserve plan --disaggregate``: the unified plan and the disaggregated layout (table or JSON)."""
    from kvserve.planner.disagg import DisaggOptions, make_disagg_plan
    from kvserve.planner.disagg_report import render_disagg_table

    try:
        link = args.kv_link_gbs * 1e9 if args.kv_link_gbs is not None else None
        plan = make_disagg_plan(build_inputs(args), DisaggOptions(link_bw=link))
    except KVServeError as exc:
        return _fail(exc, args.json)
    if args.plot:
        from kvserve.planner.plots import write_plots
        paths = write_plots(plan.unified, args.plot)
        if not args.json:
            print("plots: " + ", ".join(paths), file=sys.stderr)
    print(json.dumps(plan.to_json(), indent=2) if args.json else render_disagg_table(plan))
    return 0


def run_profile(args: argparse.Namespace) -> int:
    """``kvserve profile``: measure this machine and kvserve's step times; save a hardware entry."""
    from kvserve.planner.profile import profile_command

    try:
        return profile_command(args)
    except KVServeError as exc:
        print(f"kvserve profile: error: {exc.message}", file=sys.stderr)
        return 2


def register(subparsers) -> None:
    """Add ``plan`` and ``profile`` to the top-level ``kvserve`` parser."""
    p = subparsers.add_parser("plan", help="capacity planner: memory, TP, roofline speed, fleet and cost",
                              epilog=PLAN_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    _add_plan_args(p)
    p.set_defaults(func=run_plan)
    q = subparsers.add_parser("profile", help="measure this machine and kvserve's step times for the planner")
    q.add_argument("--name", default="local", help="hardware entry name (default: local)")
    q.add_argument("--out", help="output JSON (default ~/.cache/kvserve/hardware/<name>.json)")
    q.add_argument("--model", default=None, help="model for the engine measurements (default model if omitted)")
    q.add_argument("--quick", action="store_true", help="fewer and smaller measurements")
    q.add_argument("--skip-engine", action="store_true", help="measure bandwidth and FLOP/s only")
    q.add_argument("--refit", action="store_true", help="re-fit the saved entry's stored runs (no measuring)")
    q.add_argument("--threads", type=int, help="engine CPU threads (default: the engine's default)")
    q.add_argument("--dtype", default="auto",
                   help="the engine's weights, as the server's --dtype (float32, bfloat16, ...; default auto: "
                        "the engine's choice); the entry plans in what its engine ran")
    q.add_argument("--repeats", type=int, default=2, help="time each run this many times, keep the best")
    q.add_argument("--clock", default="auto", help="auto (cpu with --threads 1, else wall), wall or cpu")
    q.add_argument("--tensor-parallel", type=int, default=None, metavar="N",
                   help="also time the engine's all-reduce among N local ranks and fit the link the planner's "
                        "tensor-parallel cost reads (interconnect latency and bandwidth)")
    q.add_argument("--expert-parallel", type=int, default=None, metavar="N",
                   help="also time the engine's all-to-all among N local ranks and fit the link the planner's "
                        "expert-parallel cost reads (all_to_all latency and bandwidth)")
    q.add_argument("--price-per-hour", type=float, default=0.0)
    q.add_argument("--json", action="store_true", help="print the saved entry as JSON")
    q.set_defaults(func=run_profile)


def main(argv: list[str] | None = None) -> int:
    """Stand-alone entry (``python -m kvserve.planner.cli plan ...``)."""
    parser = argparse.ArgumentParser(prog="kvserve")
    register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
