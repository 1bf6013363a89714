"""``kvserve profile``: measure this machine and kvserve's own run times; save a hardware entry.

1. Memory bandwidth: best of several full reads (``sum``) of a 256 MiB tensor, and copies.
2. Matrix-multiply FLOP/s: best of several fp32 2048^3 GEMMs.
3. kvserve: timed ``LLM.generate`` runs over batch sizes and prompt lengths (prefill-only
   runs with ``max_tokens=1`` and longer decode runs), best of ``--repeats`` (other load only
   ever slows a run down), fitted by :mod:`calibrate` into efficiency factors and host
   overheads for the planner's roofline.

The saved entry (``~/.cache/kvserve/hardware/<name>.json`` or ``--out``) is read by
``kvserve plan --gpu local`` / ``--gpu-file PATH``.
"""
from __future__ import annotations

import dataclasses
import json
import os
import platform
import random
import time
from types import MappingProxyType
from typing import Callable, Sequence

from kvserve.planner.calibrate import RunSample, fit_efficiencies
from kvserve.planner.errors import PlannerInputError
from kvserve.planner.hardware import (HardwareSpec, default_hardware_dir, hardware_to_dict, load_hardware_file,
                                      save_hardware_file)
from kvserve.planner.models import ModelSpec, MoESpec
from kvserve.planner.simulate import SchedulerLimits

# (prompt lengths, max_tokens). Prefill-only runs (max_tokens=1) pair with decode runs over batch
# sizes 1-64 and contexts 16-1024; a long prompt among short ones mixes decode lengths (the torch
# backend batches decodes in length groups).
FULL_RUNS = (((16,), 1), ((16,), 48), ((1024,), 1), ((1024,), 32), ((2048,), 1), ((64,) * 4, 1),
             ((64,) * 4, 32), ((64,) * 16, 24), ((16,) * 64, 1), ((16,) * 64, 12),
             ((512,) * 16, 12), ((1024,) + (16,) * 63, 10))
QUICK_RUNS = (((16,), 1), ((16,), 24), ((512,), 1), ((64,) * 4, 16), ((16,) * 64, 6),
              ((256,) * 16, 8))


CLOCKS = {"wall": time.perf_counter, "cpu": time.process_time}


def resolve_clock(clock: str, threads: int | None) -> str:
    """``auto``: the process's CPU time when the engine runs one thread (time the OS gives other
    jobs on a shared machine is not kvserve's), wall time otherwise."""
    if clock == "auto":
        return "cpu" if threads == 1 else "wall"
    if clock not in CLOCKS:
        raise PlannerInputError(f"--clock must be auto, wall or cpu, not {clock!r}", param="clock")
    return clock


def measure_bandwidth(num_bytes: int = 256 * 2**20, repeats: int = 7, clock: str = "wall") -> dict:
    """Best-of-``repeats`` memory bandwidth in bytes/s with torch on the CPU: a full read
    (``sum``), a copy (read + write) and a matrix-vector product streaming a large matrix.
    ``bytes_per_s`` is the best of the three (the machine's attainable streaming rate)."""
    import torch

    x = torch.ones(num_bytes // 4, dtype=torch.float32)
    y = torch.empty_like(x)
    mat, vec = x.view(-1, 4096), torch.ones(4096)
    now = CLOCKS[clock]
    read, copy, matvec = 0.0, 0.0, 0.0
    for _ in range(repeats):
        t = now()
        x.sum()
        read = max(read, num_bytes / max(now() - t, 1e-9))
        t = now()
        y.copy_(x)
        copy = max(copy, 2 * num_bytes / max(now() - t, 1e-9))
        t = now()
        torch.mv(mat, vec)
        matvec = max(matvec, num_bytes / max(now() - t, 1e-9))
    return {"read_bytes_per_s": read, "copy_bytes_per_s": copy, "matvec_bytes_per_s": matvec,
            "bytes_per_s": max(read, copy, matvec), "buffer_bytes": num_bytes}


def measure_gemm_flops(n: int = 2048, repeats: int = 5, clock: str = "wall") -> dict:
    """Best-of-``repeats`` ``n x n @ n x n`` FLOP/s in fp32 and in bf16 (the engine's CPU dtype:
    on a CPU with AVX-512 BF16 or AMX its GEMMs run well above fp32's, so a roofline on the fp32
    figure alone predicts bf16 prefill too slow)."""
    import torch

    now = CLOCKS[clock]
    out = {"n": n}
    for key, dtype in (("fp32_flops", torch.float32), ("bf16_flops", torch.bfloat16)):
        a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
        torch.mm(a, b)                                 # first call: kernel selection, packing
        best = 0.0
        for _ in range(repeats):
            t = now()
            torch.mm(a, b)
            best = max(best, 2 * n ** 3 / max(now() - t, 1e-9))
        out[key] = best
    return out


def time_runs(generate: Callable[[list[list[int]], int], None],
              runs: Sequence[tuple[tuple[int, ...], int]], vocab_size: int, repeats: int = 1,
              seed: int = 0, clock: str = "wall") -> list[RunSample]:
    """Time ``generate(prompts, max_tokens)`` for each (prompt lengths, max_tokens) on ``clock``;
    fresh random prompts every call (no prefix-cache hit). Best of ``repeats``, taken as whole
    rounds over all runs so a burst of outside load spoils different runs in different rounds."""
    rng = random.Random(seed)
    now = CLOCKS[clock]
    best = [float("inf")] * len(runs)
    for _ in range(max(1, repeats)):
        for i, (lengths, max_tokens) in enumerate(runs):
            prompts = [[rng.randrange(100, vocab_size - 100) for _ in range(n)] for n in lengths]
            t = now()
            generate(prompts, max_tokens)
            best[i] = min(best[i], now() - t)
    return [RunSample(tuple(lengths), max_tokens, t) for (lengths, max_tokens), t in zip(runs, best)]


def model_from_engine(mc) -> ModelSpec:
    """ModelSpec from the engine's own ModelConfig (what the engine actually runs). A MoE
    model's dense layers are counted as ``first_dense_layers`` wherever they sit."""
    moe = None
    if mc.moe is not None:
        dense = sum(not mc.moe.is_sparse(i) for i in range(mc.num_layers))
        moe = MoESpec(num_experts=mc.moe.num_experts, experts_per_token=mc.moe.top_k,
                      expert_intermediate_size=mc.moe.expert_intermediate_size,
                      shared_intermediate_size=mc.moe.shared_expert_intermediate_size, first_dense_layers=dense)
    return ModelSpec(name=mc.name or mc.architecture, num_layers=mc.num_layers, hidden_size=mc.hidden_size,
                     intermediate_size=mc.intermediate_size, vocab_size=mc.vocab_size, num_heads=mc.num_heads,
                     num_kv_heads=mc.num_kv_heads, head_dim=mc.head_dim,
                     tie_word_embeddings=mc.tie_word_embeddings, max_context=mc.max_position_embeddings,
                     qkv_bias=mc.attention_bias, moe=moe, source="kvserve engine ModelConfig")


def runs_kv_bytes(model: str | None, runs: Sequence[tuple[tuple[int, ...], int]], block_size: int = 16) -> int:
    """KV memory the timed runs need at most: each request of the largest run holding its
    prompt, its output and a spare block, at float32 (the widest KV dtype), plus a quarter. The
    engine's default budget (on CPU 4 GiB, zero-filled at start: seconds of page faults) is
    far more than a profile uses."""
    from kvserve.loader import resolve_model_path
    from kvserve.planner.kv_memory import kv_bytes_per_token_per_gpu
    from kvserve.planner.model_io import resolve_model
    spec = resolve_model(resolve_model_path(model))
    blocks = max(sum(-(-(n + out) // block_size) + 1 for n in lengths) for lengths, out in runs)
    return int(1.25 * blocks * block_size * kv_bytes_per_token_per_gpu(spec, 4.0, 1).value)


def open_engine(model: str | None, threads: int | None, kv_cache_bytes: int | None = None, dtype: str = "auto"):
    """(generate(prompts, max_tokens), engine facts) for kvserve's offline API, with
    ``kv_cache_bytes`` of KV (None: the engine's default budget) and weights in ``dtype`` (the
    engine's ``--dtype``: "auto" lets it choose, as a server started without one does)."""
    from kvserve import LLM, SamplingParams

    kwargs = {"num_threads": threads} if threads else {}
    kwargs["dtype"] = dtype
    llm = LLM(model=model, kv_cache_bytes=kv_cache_bytes, **kwargs)

    reset = getattr(llm.engine, "reset_prefix_cache", None)

    def generate(prompts: list[list[int]], max_tokens: int) -> None:
        if reset is not None:
            reset()                        # every run computes its whole prompt
        llm.generate(prompts, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True))

    eng = llm.engine
    dtype = str(eng.dtype).replace("torch.", "")
    facts = {"model": model_from_engine(eng.model_config), "dtype": dtype,
             "max_num_seqs": llm.config.max_num_seqs, "max_num_batched_tokens": llm.config.max_num_batched_tokens,
             "block_size": llm.config.block_size, "attention_backend": llm.config.attention_backend,
             "device": str(eng.device), "threads": threads, "kv_cache_tokens": eng.kv_plan.max_tokens,
             "kv_cache_dtype": eng.kv_cache_dtype}
    return generate, facts


def base_entry(name: str, bw: dict, gemm: dict, price: float) -> HardwareSpec:
    """The raw (100%-efficiency) hardware entry from the micro-benchmarks."""
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return HardwareSpec(name=name, memory_bytes=float(ram), mem_bandwidth=bw["bytes_per_s"],
                        flops=MappingProxyType({"fp32": gemm["fp32_flops"],
                                                **({"bf16": gemm["bf16_flops"]} if gemm.get("bf16_flops") else {})}), interconnect_bw=0.0,
                        price_per_hour=price, gpus_per_node=1, mem_efficiency=1.0, kv_efficiency=1.0,
                        flops_efficiency=1.0, runtime_overhead_bytes=0.0, kv_read_mode="padded",
                        source=f"kvserve profile on {platform.node()} ({platform.processor() or platform.machine()}, "
                               f"{os.cpu_count()} CPUs)")


def calibrate_engine(raw: HardwareSpec, facts: dict, samples: list[RunSample]) -> HardwareSpec:
    """Fit the engine samples and return the calibrated entry (with the evidence attached)."""
    from kvserve.planner.dtypes import kv_dtype, weight_dtype
    from kvserve.planner.roofline import cost_model

    model: ModelSpec = facts["model"]
    dtype = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}.get(facts["dtype"], "fp32")
    mode = "padded" if facts["attention_backend"] == "torch" else "sum"
    raw = dataclasses.replace(raw, kv_read_mode=mode)
    unit = cost_model(model, raw, weight_dtype(dtype), kv_dtype(facts.get("kv_cache_dtype", dtype)), 1)
    limits = SchedulerLimits(facts["max_num_seqs"], facts["max_num_batched_tokens"], facts["block_size"])
    fit = fit_efficiencies(unit, samples, limits)
    calibration = {k: v for k, v in facts.items() if k != "model"}
    calibration.update(model=model.name, model_spec=dataclasses.asdict(model), weight_dtype=dtype,
                       rms_relative_error=round(fit.rms_relative_error, 4), runs=list(fit.per_run),
                       samples=[[list(s.prompts), s.max_tokens, s.seconds] for s in samples],
                       fitted_at=time.strftime("%Y-%m-%dT%H:%M:%S"))
    return dataclasses.replace(raw, mem_efficiency=fit.mem_efficiency, flops_efficiency=fit.flops_efficiency,
                               kv_efficiency=fit.kv_efficiency, step_overhead_s=fit.step_overhead_s,
                               seq_overhead_s=fit.seq_overhead_s, request_overhead_s=fit.request_overhead_s,
                               gemv_efficiency=fit.gemv_efficiency, calibration=MappingProxyType(calibration))


def refit_entry(hw: HardwareSpec) -> HardwareSpec:
    """Re-fit a saved entry from its stored samples (after a change to the fit, no re-measuring)."""
    cal = dict(hw.calibration)
    if "samples" not in cal or "model_spec" not in cal:
        raise PlannerInputError("this hardware entry has no stored engine samples to refit", param="refit")
    spec = {k: v for k, v in cal["model_spec"].items() if k not in ("mla", "moe")}
    facts = {k: cal[k] for k in ("dtype", "max_num_seqs", "max_num_batched_tokens", "block_size",
                                 "attention_backend", "device", "threads", "kv_cache_tokens", "kv_cache_dtype") if k in cal}
    facts["model"] = ModelSpec(**spec)
    samples = [RunSample(tuple(p), int(n), float(s)) for p, n, s in cal["samples"]]
    raw = dataclasses.replace(hw, mem_efficiency=1.0, kv_efficiency=1.0, flops_efficiency=1.0,
                              gemv_efficiency=None, step_overhead_s=0.0, seq_overhead_s=0.0,
                              request_overhead_s=0.0)
    out = calibrate_engine(raw, facts, samples)
    keep = {k: cal[k] for k in ("bandwidth", "gemm", "clock", "load_average_1m", "allreduce") if k in cal}
    return dataclasses.replace(out, calibration=MappingProxyType({**out.calibration, **keep}))


def measure(args) -> HardwareSpec:
    """Micro-benchmarks, then (unless --skip-engine) timed kvserve runs and the fit."""
    threads = getattr(args, "threads", None)
    if threads:
        import torch
        torch.set_num_threads(threads)    # measure with the threads the engine will use
    clock = resolve_clock(getattr(args, "clock", "auto"), threads)
    print(f"measuring memory bandwidth and fp32 GEMM FLOP/s ({clock} clock) ...", flush=True)
    bw, gemm = measure_bandwidth(clock=clock), measure_gemm_flops(clock=clock)
    hw = base_entry(args.name, bw, gemm, args.price_per_hour)
    if not args.skip_engine:
        print("timing kvserve runs (this takes a few minutes) ...", flush=True)
        runs = QUICK_RUNS if args.quick else FULL_RUNS
        generate, facts = open_engine(args.model, threads, runs_kv_bytes(args.model, runs),
                                      getattr(args, "dtype", None) or "auto")
        generate([[101] * 8], 2)                                   # warm-up
        samples = time_runs(generate, runs, facts["model"].vocab_size,
                            repeats=getattr(args, "repeats", 2) or 1, clock=clock)
        hw = calibrate_engine(hw, facts, samples)
    hw = dataclasses.replace(hw, calibration=MappingProxyType(
        {**hw.calibration, "bandwidth": bw, "gemm": gemm, "threads": threads, "clock": clock,
         "load_average_1m": round(os.getloadavg()[0], 2)}))
    ranks = getattr(args, "tensor_parallel", None) or 1
    hw = calibrate_allreduce(hw, ranks) if ranks > 1 else hw
    if ranks > 1 and hw.calibration["allreduce"]["device"] == "cpu":      # CUDA ranks' skew: not probed
        hw = calibrate_rank_skew(hw, ranks)
    ep = getattr(args, "expert_parallel", None) or 1
    return calibrate_all_to_all(hw, ep) if ep > 1 else hw


def calibrate_allreduce(hw: HardwareSpec, ranks: int) -> HardwareSpec:
    """The entry with its link fitted to ``ranks`` local ranks' measured all-reduces
    (``kvserve.parallel.collective_bench``): ``interconnect_latency_s`` and ``interconnect_bw``
    as ``roofline.allreduce_s`` reads them, ``gpus_per_node`` = ``ranks`` (they share the link),
    and the samples in the calibration."""
    from kvserve.parallel.collective_bench import calibrate
    record = calibrate("all_reduce", ranks)
    return dataclasses.replace(hw, interconnect_bw=record["bytes_per_s"], interconnect_latency_s=record["latency_s"],
                               gpus_per_node=ranks, calibration=MappingProxyType({**hw.calibration, "allreduce": record}))


def calibrate_rank_skew(hw: HardwareSpec, ranks: int) -> HardwareSpec:
    """The entry with its ranks' skew measured among ``ranks`` local CPU ranks
    (``collective_bench.measure_skew``): ``rank_skew_fixed_s``, ``rank_jitter_cv`` and
    ``dispatch_s`` as ``rank_skew.rank_skew_s`` reads them, the samples in the calibration."""
    from kvserve.parallel.collective_bench import fit_skew, measure_skew
    print(f"timing the skew of {ranks} cpu ranks at their all-reduces ...", flush=True)
    record = measure_skew(ranks)
    fixed, cv = fit_skew(record, ranks)
    record = {**record, "ranks": ranks, "fixed_s": fixed, "cv": cv}
    return dataclasses.replace(hw, rank_skew_fixed_s=fixed, rank_jitter_cv=cv, dispatch_s=record["dispatch_s"],
                               calibration=MappingProxyType({**hw.calibration, "rank_skew": record}))


def calibrate_all_to_all(hw: HardwareSpec, ranks: int) -> HardwareSpec:
    """The entry with expert parallelism's all-to-all fitted to ``ranks`` local ranks' measured
    ones (``kvserve.parallel.collective_bench``): ``all_to_all_latency_s`` and ``all_to_all_bw``
    as ``moe.all_to_all_s`` reads them, and the samples in the calibration."""
    from kvserve.parallel.collective_bench import calibrate
    record = calibrate("all_to_all", ranks)
    return dataclasses.replace(hw, all_to_all_bw=record["bytes_per_s"], all_to_all_latency_s=record["latency_s"],
                               gpus_per_node=max(hw.gpus_per_node, ranks),
                               calibration=MappingProxyType({**hw.calibration, "all_to_all": record}))


def summary(hw: HardwareSpec) -> list[str]:
    """Human lines: rates, fitted factors, per-run predicted vs measured."""
    cal = dict(hw.calibration)
    bw, gemm = cal.get("bandwidth", {}), cal.get("gemm", {})
    lines = [f"bandwidth {hw.mem_bandwidth / 1e9:.1f} GB/s (read {bw.get('read_bytes_per_s', 0) / 1e9:.1f}, copy "
             f"{bw.get('copy_bytes_per_s', 0) / 1e9:.1f}, matvec {bw.get('matvec_bytes_per_s', 0) / 1e9:.1f}); "
             f"fp32 GEMM {gemm.get('fp32_flops', 0) / 1e9:.1f} GFLOP/s, bf16 {gemm.get('bf16_flops', 0) / 1e9:.1f}"]
    if "runs" in cal:
        lines.append(f"fitted: weight streaming eff {hw.mem_efficiency:.3f} (multi-token GEMMs; one-token "
                     f"steps {hw.gemv_efficiency or hw.mem_efficiency:.3f}), GEMM FLOP/s eff "
                     f"{hw.flops_efficiency:.3f}, KV read eff {hw.kv_efficiency:.3f}, host overhead "
                     f"{hw.step_overhead_s * 1e3:.2f} ms/step + {hw.seq_overhead_s * 1e3:.3f} ms/seq/step + "
                     f"{hw.request_overhead_s * 1e3:.2f} ms/request; rms error {cal['rms_relative_error']:.1%} "
                     f"({cal.get('clock', 'wall')} clock)")
        lines += [f"  {run}" for run in cal["runs"]]
    if "allreduce" in cal:
        ar = cal["allreduce"]
        lines.append(f"all-reduce among {ar['ranks']} {ar['device']} ranks: {ar['latency_s'] * 1e6:.1f} us + bytes / "
                     f"{ar['bytes_per_s'] / 1e9:.2f} GB/s (ring: 2 (n - 1) / n x bytes)")
    if "rank_skew" in cal:
        sk = cal["rank_skew"]
        lines.append(f"skew of {sk['ranks']} cpu ranks: {sk['fixed_s'] * 1e6:.1f} us per collective + jitter cv "
                     f"{sk['cv']:.3f} of the compute between collectives; dispatch {sk['dispatch_s'] * 1e6:.0f} us "
                     f"per forward")
    if "all_to_all" in cal:
        a2a = cal["all_to_all"]
        lines.append(f"all-to-all among {a2a['ranks']} {a2a['device']} ranks: {a2a['latency_s'] * 1e6:.1f} us + "
                     f"bytes / {a2a['bytes_per_s'] / 1e9:.2f} GB/s ((n - 1) / n of a rank's rows leave it)")
    return lines


def profile_command(args) -> int:
    """Measure (or --refit), save, print a summary (or the entry as JSON)."""
    path = args.out or os.path.join(default_hardware_dir(), f"{args.name}.json")
    if getattr(args, "refit", False):
        hw = refit_entry(load_hardware_file(path))
    else:
        hw = measure(args)
    save_hardware_file(hw, path)
    if args.json:
        print(json.dumps(hardware_to_dict(hw), indent=2))
    else:
        print("\n".join(summary(hw) + [f"saved {path}"]))
    return 0
