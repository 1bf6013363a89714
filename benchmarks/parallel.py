"""Tensor and expert parallelism on this machine, and the planner's TP prediction for a 70B model.

One process drives the engines (rank 0); TP/EP ranks are worker processes. Same requests for
every layout, measured in the same run:

- **TP**: a random-initialised Llama with SmolLM2-135M's shape but 8 heads / 4 KV heads (so
  TP=2 divides them; SmolLM2's own 9 heads only split 3 ways): 16 requests of 128 prompt
  tokens, 64 output tokens, greedy, prefix cache off. TP=1 with 2 threads and with 1, TP=2
  with 1 thread per rank (2 cores). Prefill seconds from a ``max_tokens=1`` run of the same
  prompts; TPOT = (total - prefill) / 63 decode steps; the collectives' share is rank 0's
  seconds inside all-reduce / all-gather over the run's seconds, and how many of them rank 0
  waited for the other rank (the ranks' stamped arrivals, ``parallel/skew.py``); and the
  planner's collective time for the decode steps, wire and skew apart, on the link and skew
  measured on this host (what ``kvserve profile --tensor-parallel 2`` stores) against those.
- **EP**: a random-initialised Qwen2-MoE (16 experts, top-2, shared expert), EP=2 (experts
  8 + 8) vs one process, batches of 1..64 decoding sequences: the share of the run spent in
  the sparse layers' collectives (two all-to-alls and an all-gather), their per-forward p50
  and p99 and the ratio, and the expert load imbalance (max / mean rows per expert, and per
  rank) on the model's routing; beside them the planner's all-to-all per forward
  (``moe.all_to_all_s``) on the link fitted to this host's measured all-to-alls (the fit
  ``kvserve profile --expert-parallel 2`` stores).
- **Planner**: ``kvserve plan`` for llama-3-70b on H100-SXM at TP 1/2/4/8 (bf16, 32 x 8k).

    .venv/bin/python benchmarks/parallel.py [--out benchmarks/parallel.json] [--quick]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from benchmarks.bench_host import emit  # noqa: E402


def save_llama(folder: str) -> None:
    """SmolLM2-135M's shape (30 layers, hidden 576, MLP 1536, vocab 49152, untied) with 8 heads of 72."""
    import transformers
    from transformers import AutoTokenizer

    from kvserve.loader import default_model_path
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536,
                                      num_hidden_layers=30, num_attention_heads=8, num_key_value_heads=4,
                                      max_position_embeddings=2048, initializer_range=0.02,
                                      bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)
    transformers.LlamaForCausalLM(config).eval().save_pretrained(folder, safe_serialization=True)
    folder_name, file_name = default_model_path().rsplit("/", 1)
    AutoTokenizer.from_pretrained(folder_name, gguf_file=file_name).save_pretrained(folder)


def save_moe(folder: str) -> None:
    """A Qwen2-MoE: 4 layers, hidden 256, 16 experts of 256, top-2, shared expert 512."""
    from tests.model.test_moe import _save_byte_tokenizer
    from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM
    from pathlib import Path
    torch.manual_seed(0)
    config = Qwen2MoeConfig(vocab_size=258, hidden_size=256, intermediate_size=512, moe_intermediate_size=256,
                            shared_expert_intermediate_size=512, num_hidden_layers=4, num_attention_heads=8,
                            num_key_value_heads=4, num_experts=16, num_experts_per_tok=2, norm_topk_prob=True,
                            max_position_embeddings=1024, initializer_range=0.1, bos_token_id=256,
                            eos_token_id=257, tie_word_embeddings=False, dtype="float32")
    Qwen2MoeForCausalLM(config).eval().save_pretrained(folder, safe_serialization=True)
    _save_byte_tokenizer(Path(folder))


def timed_generate(llm, prompts, max_tokens: int) -> float:
    from kvserve.sampling.params import SamplingParams
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    started = time.perf_counter()
    llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    return time.perf_counter() - started


def comm(llm) -> float:
    return getattr(llm.engine.runner, "comm_seconds", 0.0)


def skew(llm):
    """Rank 0's ``ArrivalSkew`` so far (a copy), or None on one rank."""
    group = getattr(llm.engine.runner, "group", None)
    return group.skew.snapshot() if group is not None else None


def tp_layout(folder: str, tp: int, threads: int, prompts, output_tokens: int) -> dict:
    from kvserve import LLM
    llm = LLM(folder, dtype="float32", kv_cache_bytes=256 * 2**20, tensor_parallel_size=tp, num_threads=threads,
              enable_prefix_cache=False, max_num_seqs=64, max_num_batched_tokens=1024)
    try:
        timed_generate(llm, prompts[:2], 4)                                 # warm-up
        c0, s0 = comm(llm), skew(llm)
        prefill_s = timed_generate(llm, prompts, 1)
        c1, s1 = comm(llm), skew(llm)
        total_s = timed_generate(llm, prompts, output_tokens)
        c2, s2 = comm(llm), skew(llm)
    finally:
        llm.engine.close()
    decode_s = total_s - prefill_s
    row = {"tp": tp, "threads_per_rank": threads, "prefill_s": round(prefill_s, 3), "total_s": round(total_s, 3),
           "output_tokens_per_s": round(len(prompts) * output_tokens / total_s, 1),
           "tpot_ms": round(decode_s / (output_tokens - 1) * 1e3, 2),
           "collective_share_prefill": round((c1 - c0) / prefill_s, 3),
           "collective_share_run": round((c2 - c1) / total_s, 3),
           "collective_s_decode": round((c2 - c1) - (c1 - c0), 4)}
    if s0 is not None:             # rank 0's waits for the last rank in the decode steps (run less prefill)
        run, prefill = s2.since(s1), s1.since(s0)
        row["collective_wait_s_decode"] = round(run.wait_s + run.wait_first_s - prefill.wait_s - prefill.wait_first_s, 4)
        row["arrival_spread_s_decode"] = round(run.spread_s + run.spread_first_s - prefill.spread_s
                                               - prefill.spread_first_s, 4)
        row["decode_s"] = round(decode_s, 4)
    return row


def host_collectives():
    """This host's entry with its 2-rank all-reduce link and skew measured (what ``kvserve
    profile --tensor-parallel 2`` stores), taken before any engine runs in this process."""
    from kvserve.planner.hardware import HardwareSpec
    from kvserve.planner.profile import calibrate_allreduce, calibrate_rank_skew
    return calibrate_rank_skew(calibrate_allreduce(HardwareSpec(
        name="this host, 2 ranks", memory_bytes=24e9, mem_bandwidth=28e9, flops={"fp32": 1.6e11},
        gpus_per_node=2), 2), 2)


def planner_collectives(folder: str, hw, batch: int, decode_steps: int, measured: dict) -> dict:
    """The planner's collective time for the TP=2 run's decode steps on this host's measured
    link and skew (``kvserve profile --tensor-parallel 2``'s measurements): the wire
    (``roofline.allreduce_s``: two all-reduces per layer and the embedding's of [batch, hidden],
    the gather of the batch's logits) against rank 0's
    collective seconds less its waits for the other rank, and the skew (``rank_skew.rank_skew_s``
    on the measured compute per step: the decode seconds less the collectives') against the
    measured spread of the ranks' arrivals (last over mean: what the step loses, whichever
    rank is late; rank 0's own waits beside it), and their sum against rank 0's collective
    seconds."""
    from kvserve.loader import load_checkpoint
    from kvserve.planner.dtypes import kv_dtype, weight_dtype
    from kvserve.planner.profile import model_from_engine
    from kvserve.planner.rank_skew import rank_skew_s
    from kvserve.planner.roofline import allreduce_s, collectives_per_step, cost_model
    cm = cost_model(model_from_engine(load_checkpoint(folder).config), hw, weight_dtype("fp32"), kv_dtype("fp32"), 2)
    total, waits, spread = (measured[k] for k in ("collective_s_decode", "collective_wait_s_decode",
                                                   "arrival_spread_s_decode"))
    compute_per_step = (measured["decode_s"] - total) / decode_steps
    wire = decode_steps * allreduce_s(cm, batch, batch)
    skewed = decode_steps * rank_skew_s(hw, 2, collectives_per_step(cm), compute_per_step)
    return {"fitted_latency_us": round(hw.interconnect_latency_s * 1e6, 1),
            "fitted_link_GBps": round(hw.interconnect_bw / 1e9, 2),
            "fitted_skew": {"fixed_us": round(hw.rank_skew_fixed_s * 1e6, 2), "jitter_cv": round(hw.rank_jitter_cv, 4),
                            "dispatch_us": round(hw.dispatch_s * 1e6, 1)},
            "probe_us_per_segment": [{"compute": round(c * 1e6, 1), "spread": round(sp * 1e6, 1),
                                      "all_reduce_less_wait": round(w * 1e6, 1)}
                                     for c, sp, w in hw.calibration["rank_skew"]["segments"]],
            "measured_decode_us_per_call_less_wait": round((total - waits) / (decode_steps * collectives_per_step(cm))
                                                           * 1e6, 1),
            "predicted_decode_wire_s": round(wire, 4), "measured_decode_wire_s": round(total - waits, 4),
            "predicted_decode_skew_s": round(skewed, 4), "measured_decode_spread_s": round(spread, 4),
            "measured_decode_rank0_wait_s": round(waits, 4), "measured_decode_collective_s": round(total, 4),
            "wire_predicted_over_measured": _ratio(wire, total - waits),
            "skew_predicted_over_measured": _ratio(skewed, spread),
            "predicted_decode_collective_s": round(wire + skewed, 4),
            "predicted_over_measured": _ratio(wire + skewed, total)}


def _ratio(predicted: float, measured: float) -> float | None:
    return round(predicted / measured, 3) if measured > 0 else None


def bench_tp(quick: bool) -> dict:
    with tempfile.TemporaryDirectory(prefix="kvserve-tp-bench-") as folder:      # 0.6 GB of weights
        save_llama(folder)
        return _bench_tp(folder, quick)


def _bench_tp(folder: str, quick: bool) -> dict:
    import random
    rng = random.Random(0)
    count, output_tokens = (4, 16) if quick else (16, 64)
    prompts = [[rng.randrange(3, 49152) for _ in range(128)] for _ in range(count)]
    hw = host_collectives()
    runs = [tp_layout(folder, 1, 2, prompts, output_tokens), tp_layout(folder, 1, 1, prompts, output_tokens),
            tp_layout(folder, 2, 1, prompts, output_tokens)]
    tp1, tp2 = runs[0], runs[2]
    planner = planner_collectives(folder, hw, count, output_tokens - 1, tp2)
    return {"model": "random Llama, SmolLM2-135M shape with 8 heads / 4 KV heads (fp32)",
            "requests": count, "prompt_tokens": 128, "output_tokens": output_tokens, "runs": runs,
            "tp2_vs_tp1_2threads": {"throughput": round(tp2["output_tokens_per_s"] / tp1["output_tokens_per_s"], 3),
                                    "tpot": round(tp2["tpot_ms"] / tp1["tpot_ms"], 3)},
            "planner_collectives_tp2": planner}


def ep_batch(llm, prompts, output_tokens: int) -> dict:
    blocks = llm.engine.runner.model.expert_parallel_blocks() if hasattr(llm.engine.runner, "group") else {}
    for b in blocks.values():
        b.comm_seconds.clear()
        b.load_history.clear()
    elapsed = timed_generate(llm, prompts, output_tokens)
    out = {"batch": len(prompts), "seconds": round(elapsed, 3)}
    if not blocks:
        return out
    per_forward = [s for b in blocks.values() for s in b.comm_seconds]
    loads = [load.float() for b in blocks.values() for load in b.load_history]
    world = llm.engine.runner.group.world_size
    p50, p99 = (statistics.quantiles(per_forward, n=100)[i] for i in (49, 98))
    out.update({"sparse_collective_share": round(sum(per_forward) / elapsed, 3),
                "all_to_all_p50_ms": round(p50 * 1e3, 3), "all_to_all_p99_ms": round(p99 * 1e3, 3),
                "p99_over_p50": round(p99 / p50, 2),
                "expert_imbalance_max_over_mean": round(statistics.mean(float(l.max() / l.mean()) for l in loads), 2),
                "rank_imbalance_max_over_mean": round(statistics.mean(
                    float(l.view(world, -1).sum(1).max() / l.view(world, -1).sum(1).mean()) for l in loads), 3)})
    return out


def bench_ep(quick: bool) -> dict:
    with tempfile.TemporaryDirectory(prefix="kvserve-ep-bench-") as folder:
        save_moe(folder)
        return _bench_ep(folder, quick)


def _bench_ep(folder: str, quick: bool) -> dict:
    import random

    from kvserve import LLM
    rng = random.Random(1)
    batches = [1, 8] if quick else [1, 4, 16, 64]
    output_tokens = 8 if quick else 32
    result = {"model": "random Qwen2-MoE: 4 layers, hidden 256, 16 experts x 256, top-2, shared 512 (fp32)",
              "prompt_tokens": 16, "output_tokens": output_tokens, "layouts": {}}
    result["planner_all_to_all"] = planner_all_to_all(folder, batches)    # before any engine runs here
    for ep, threads in ((1, 2), (2, 1)):
        llm = LLM(folder, dtype="float32", kv_cache_bytes=64 * 2**20, tensor_parallel_size=ep, num_threads=threads,
                  enable_prefix_cache=False, max_num_seqs=64)
        try:
            timed_generate(llm, [[rng.randrange(256) for _ in range(16)]], 2)      # warm-up
            result["layouts"][f"ep{ep}"] = [ep_batch(llm, [[rng.randrange(256) for _ in range(16)]
                                                           for _ in range(b)], output_tokens) for b in batches]
        finally:
            llm.engine.close()
    for row, (batch, predicted) in zip(result["layouts"]["ep2"], result["planner_all_to_all"]["per_forward_ms"]):
        row["planner_all_to_all_ms"] = predicted
        row["planner_over_measured_p50"] = round(predicted / row["all_to_all_p50_ms"], 3)
    return result


def planner_all_to_all(folder: str, batches: list[int]) -> dict:
    """The planner's dispatch + combine seconds of one sparse layer's forward at each decode batch
    (``moe.all_to_all_s``, fp32 activations, ``ceil(batch / 2)`` tokens per rank) on the
    all-to-all fitted to this host's measured ones (``kvserve profile --expert-parallel 2``'s
    fit), to set beside the measured per-forward p50 (which also holds the slices' all-gather)."""
    from kvserve.loader import load_checkpoint
    from kvserve.planner.hardware import HardwareSpec
    from kvserve.planner.moe import all_to_all_s
    from kvserve.planner.profile import calibrate_all_to_all, model_from_engine
    hw = calibrate_all_to_all(HardwareSpec(name="this host", memory_bytes=24e9, mem_bandwidth=28e9,
                                           flops={"fp32": 1.6e11}, gpus_per_node=2), 2)
    link, latency = hw.all_to_all_link()
    model = model_from_engine(load_checkpoint(folder).config)
    return {"fitted_latency_us": round(latency * 1e6, 1), "fitted_link_GBps": round(link / 1e9, 2),
            "per_forward_ms": [[b, round(all_to_all_s(model, hw, 2, -(-b // 2), 4.0)[1] * 1e3, 4)] for b in batches]}


def planner_tp() -> list[dict]:
    from kvserve.planner.candidates import PlanInputs, PlanOptions
    from kvserve.planner.dtypes import kv_dtype, weight_dtype
    from kvserve.planner.hardware import CATALOG
    from kvserve.planner.plan import make_plan
    from kvserve.planner.presets import preset
    from kvserve.planner.workload import Workload
    rows = []
    for tp in (1, 2, 4, 8):
        inputs = PlanInputs(preset("llama-3-70b"), CATALOG["h100-sxm"], weight_dtype("bf16"), kv_dtype("bf16"),
                            Workload(context=8192, concurrency=32), options=PlanOptions(tp=tp))
        try:
            plan = make_plan(inputs)
        except Exception as exc:      # the planner refuses a TP whose weights do not fit
            rows.append({"tp": tp, "fits": False, "why": str(exc)[:200]})
            continue
        pick = {f.name: f.value for f in plan.figures}
        rows.append({"tp": tp, "fits": True, **{k: round(pick[k], 4) for k in
                     ("kv_tokens_per_replica", "max_concurrency", "decode_ms_per_token_bs1", "tpot_ms", "replicas",
                      "gpus", "output_tokens_per_s_per_gpu")
                     if k in pick}})
    return rows


PARTS = {"tp": bench_tp, "ep": bench_ep, "planner_llama3_70b_h100": lambda quick: planner_tp()}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default=None)
    parser.add_argument("--quick", action="store_true", help="small sizes (a smoke run)")
    parser.add_argument("--only", choices=sorted(PARTS), default=None,
                        help="run this part only (with --out: replace it in the saved JSON, keep the others)")
    args = parser.parse_args()
    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")), "")
    result = {"cpu": cpu, "cores": os.cpu_count()}
    if args.only and args.out and os.path.exists(args.out):
        with open(args.out) as f:
            result = {**json.load(f), **result}
    for name, run in PARTS.items():
        if args.only in (None, name):
            result[name] = run(args.quick)
    emit(result, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
