"""Offline throughput on a CUDA device: kvserve (bf16; decode graphs on, off) vs HF transformers (bf16).

The workload of ``offline_throughput.py`` (prompt lengths uniform in [16, 1024], outputs in
[16, 256], greedy, ignore_eos, all at once), on ``cuda``, with decode steps replayed as CUDA
graphs (the default) and eager (``cuda_graphs=False``); plus single-request decode tokens/s
against the weight-read bound (weight bytes / the device's measured copy bandwidth).

    python benchmarks/gpu_throughput.py [--requests 256] [--hf-batch 64]

Prints one JSON object. Skips (prints a reason) without CUDA.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from benchmarks.offline_throughput import make_workload, run_bs1, run_kvserve  # noqa: E402


def device_copy_bandwidth(num_bytes: int = 1 << 30) -> float:
    """Bytes read + written per second by a device-to-device copy (best of 5)."""
    x = torch.empty(num_bytes // 2, dtype=torch.bfloat16, device="cuda")
    y = torch.empty_like(x)
    best = float("inf")
    for _ in range(5):
        torch.cuda.synchronize()
        t = time.perf_counter()
        y.copy_(x)
        torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t)
    return 2 * num_bytes / best


def run_hf_cuda(model_path: str, requests, batch_size: int) -> float:
    """HF generate in bf16 on cuda, static left-padded batches; own tokens counted."""
    from transformers import AutoModelForCausalLM
    folder, name = os.path.split(model_path)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.bfloat16).cuda().eval()
    model.generation_config.eos_token_id = None
    torch.cuda.synchronize()
    t = time.perf_counter()
    with torch.inference_mode():
        for b in range(0, len(requests), batch_size):
            batch = requests[b:b + batch_size]
            width = max(len(p) for p, _ in batch)
            ids = torch.tensor([[2] * (width - len(p)) + p for p, _ in batch], device="cuda")
            mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p, _ in batch], device="cuda")
            longest = max(n for _, n in batch)
            model.generate(ids, attention_mask=mask, max_new_tokens=longest, min_new_tokens=longest,
                           do_sample=False, pad_token_id=2)
    torch.cuda.synchronize()
    return sum(n for _, n in requests) / (time.perf_counter() - t)


def measure_engine(path: str, requests, **engine_kwargs) -> dict:
    """Throughput of the whole workload and bs=1 decode tokens/s of one engine."""
    from kvserve import LLM
    llm = LLM(path, device="cuda", kv_cache_bytes=8 * 2**30, max_num_seqs=256, max_num_batched_tokens=8192,
              **engine_kwargs)
    run_kvserve(llm, requests[:8])                                  # warm-up
    tokens_per_s, seconds = run_kvserve(llm, requests)
    bs1 = run_bs1(llm, requests[0][0])
    graphs = llm.engine.runner.decode_graphs
    out = {"output_tokens_per_s": round(tokens_per_s, 1), "seconds": round(seconds, 2),
           "bs1_decode_tokens_per_s": round(bs1, 1)}
    if graphs is not None:
        out.update(graphs_captured=len(graphs.entries), capture_seconds=round(graphs.capture_seconds, 2))
    out["weight_bytes"] = sum(p.numel() * p.element_size() for p in llm.engine.runner.model.parameters())
    del llm
    torch.cuda.empty_cache()
    return out


def bs1_breakdown(path: str, prompt: list[int], replays: int = 200) -> dict:
    """Where a graphed one-sequence decode step goes: the whole engine step (1 / tokens per s)
    against replaying its captured graph alone (device time plus one launch), the rest being
    the host's scheduling, input filling, vocabulary head and sampling."""
    from kvserve import LLM
    llm = LLM(path, device="cuda", kv_cache_bytes=2**30)
    run_bs1(llm, prompt)                    # captures the buckets the context passes through
    bs1 = run_bs1(llm, prompt)
    graphs = llm.engine.runner.decode_graphs
    entry = next(e for (rows, _), e in sorted(graphs.entries.items(), key=lambda kv: -kv[0][1]) if rows == 1)
    torch.cuda.synchronize()
    started = time.perf_counter()
    for _ in range(replays):
        entry.graph.replay()
    torch.cuda.synchronize()
    replay_ms = (time.perf_counter() - started) / replays * 1e3
    step_ms = 1e3 / bs1
    return {"bs1_decode_tokens_per_s": round(bs1, 1), "step_ms": round(step_ms, 3),
            "graph_replay_ms": round(replay_ms, 3), "host_rest_ms": round(step_ms - replay_ms, 3)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=256)
    parser.add_argument("--hf-batch", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--bs1-breakdown", action="store_true",
                        help="only the graphed bs=1 step's split: graph replay vs the rest of the step")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print(json.dumps({"skipped": "no CUDA device"}))
        return
    if args.bs1_breakdown:
        from kvserve.loader import default_model_path
        from kvserve.tokenizer import Tokenizer
        path = default_model_path()
        print(json.dumps(bs1_breakdown(path, make_workload(Tokenizer.load(path), 1, args.seed)[0][0]), indent=1))
        return
    from kvserve.loader import default_model_path
    from kvserve.tokenizer import Tokenizer
    path = default_model_path()
    requests = make_workload(Tokenizer.load(path), args.requests, args.seed)
    graphs = measure_engine(path, requests)
    eager = measure_engine(path, requests, cuda_graphs=False)
    bandwidth = device_copy_bandwidth()
    hf = run_hf_cuda(path, requests, args.hf_batch)
    bound = bandwidth / graphs["weight_bytes"]
    print(json.dumps({
        "device": torch.cuda.get_device_name(0), "torch": torch.__version__, "requests": args.requests,
        "kvserve_graphs": graphs, "kvserve_eager": eager, "hf_output_tokens_per_s": round(hf, 1),
        "ratio_vs_hf": round(graphs["output_tokens_per_s"] / hf, 3),
        "eager_ratio_vs_hf": round(eager["output_tokens_per_s"] / hf, 3),
        "graphs_vs_eager_throughput": round(graphs["output_tokens_per_s"] / eager["output_tokens_per_s"], 3),
        "graphs_vs_eager_bs1": round(graphs["bs1_decode_tokens_per_s"] / eager["bs1_decode_tokens_per_s"], 3),
        "copy_bandwidth_bytes_per_s": round(bandwidth), "bs1_bound_tokens_per_s": round(bound, 1),
        "bs1_fraction_of_bound": round(graphs["bs1_decode_tokens_per_s"] / bound, 4)}, indent=1))


if __name__ == "__main__":
    main()
