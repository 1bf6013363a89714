"""Offline throughput on a CUDA device: kvserve (bf16) vs Hugging Face transformers (bf16), same run.

The workload of ``offline_throughput.py`` (prompt lengths uniform in [16, 1024], outputs in
[16, 256], greedy, ignore_eos, all at once), on ``cuda``; plus single-request decode tokens/s
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=256)
    parser.add_argument("--hf-batch", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print(json.dumps({"skipped": "no CUDA device"}))
        return
    from kvserve import LLM
    from kvserve.loader import default_model_path
    path = default_model_path()
    llm = LLM(path, device="cuda", kv_cache_bytes=8 * 2**30, max_num_seqs=256, max_num_batched_tokens=8192)
    requests = make_workload(llm.tokenizer, args.requests, args.seed)
    run_kvserve(llm, requests[:8])                                  # warm-up
    ours, ours_s = run_kvserve(llm, requests)
    bs1 = run_bs1(llm, requests[0][0])
    weight_bytes = sum(p.numel() * p.element_size() for p in llm.engine.runner.model.parameters())
    bandwidth = device_copy_bandwidth()
    hf = run_hf_cuda(path, requests, args.hf_batch)
    print(json.dumps({
        "device": torch.cuda.get_device_name(0), "torch": torch.__version__, "requests": args.requests,
        "kvserve_output_tokens_per_s": round(ours, 1), "kvserve_seconds": round(ours_s, 2),
        "hf_output_tokens_per_s": round(hf, 1), "ratio_vs_hf": round(ours / hf, 3),
        "bs1_decode_tokens_per_s": round(bs1, 1), "weight_bytes": weight_bytes,
        "copy_bandwidth_bytes_per_s": round(bandwidth), "bs1_bound_tokens_per_s": round(bandwidth / weight_bytes, 1),
        "bs1_fraction_of_bound": round(bs1 / (bandwidth / weight_bytes), 4)}, indent=1))


if __name__ == "__main__":
    main()
