"""Offline throughput: kvserve vs Hugging Face transformers, and bs=1 decode vs the bandwidth bound.

One process, the same requests for both engines, figures measured in the same run:
64 requests, prompt lengths uniform in [16, 1024], output lengths uniform in [16, 256]
(random.Random(seed)), greedy, ignore_eos, all arriving at once.

    .venv/bin/python benchmarks/offline_throughput.py [--requests 64] [--threads 2]

Prints one JSON object: kvserve and HF output tokens/s and ``ratio_vs_hf``; single-request
decode tokens/s, the measured memory bandwidth, weight bytes, the bound and
``bs1_fraction_of_bound``.
"""
from __future__ import annotations

import argparse
import inspect
import json
import os
import random
import sys
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import torch  # noqa: E402


def make_workload(tokenizer, num_requests: int, seed: int):
    """Prompts are slices of real source text; lengths drawn from a fixed seed."""
    import email.message, json.decoder, textwrap, argparse as ap  # noqa: E401  real text
    corpus = "\n".join(inspect.getsource(m) for m in (json.decoder, textwrap, ap, email.message))
    ids = tokenizer.encode(corpus, add_special_tokens=False)
    rng = random.Random(seed)
    requests = []
    for _ in range(num_requests):
        prompt_len, output_len = rng.randint(16, 1024), rng.randint(16, 256)
        start = rng.randint(0, len(ids) - prompt_len - 1)
        requests.append((ids[start:start + prompt_len], output_len))
    return requests


def measure_read_bandwidth(num_bytes: int = 1 << 30, repeats: int = 5) -> float:
    """Best-of-N read bandwidth in bytes/s (sum over a large fp32 tensor)."""
    x = torch.ones(num_bytes // 4, dtype=torch.float32)
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        x.sum()
        best = min(best, time.perf_counter() - t)
    return num_bytes / best


def run_kvserve(llm, requests):
    from kvserve.sampling.params import SamplingParams
    prompts = [{"prompt_token_ids": p} for p, _ in requests]
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for _, n in requests]
    t = time.perf_counter()
    outputs = llm.generate(prompts, params)
    elapsed = time.perf_counter() - t
    produced = sum(len(o.outputs[0].token_ids) for o in outputs)
    assert produced == sum(n for _, n in requests)
    return produced / elapsed, elapsed


def run_bs1(llm, prompt, num_tokens: int = 128):
    """Decode tokens/s of one request: time after its first token, divided by the rest."""
    from kvserve.engine.request import EngineRequest
    from kvserve.sampling.params import SamplingParams
    engine = llm.engine
    engine.add_request(EngineRequest("bs1", prompt, SamplingParams(temperature=0, max_tokens=num_tokens,
                                                                   ignore_eos=True)))
    engine.step()                                           # prefill + first token
    t = time.perf_counter()
    steps = 0
    while engine.has_unfinished():
        engine.step()
        steps += 1
    return steps / (time.perf_counter() - t)


def run_hf(model_path, requests, batch_size: int):
    """HF generate with static left-padded batches, in arrival order; only each request's
    own tokens count as output (a static batch runs until its longest request)."""
    from transformers import AutoModelForCausalLM
    folder, name = os.path.split(model_path)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None
    t = time.perf_counter()
    with torch.inference_mode():
        for b in range(0, len(requests), batch_size):
            batch = requests[b:b + batch_size]
            width = max(len(p) for p, _ in batch)
            ids = torch.tensor([[2] * (width - len(p)) + p for p, _ in batch])
            mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p, _ in batch])
            model.generate(ids, attention_mask=mask, max_new_tokens=max(n for _, n in batch),
                           min_new_tokens=max(n for _, n in batch), do_sample=False, pad_token_id=2)
    elapsed = time.perf_counter() - t
    return sum(n for _, n in requests) / elapsed, elapsed


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=os.cpu_count())
    parser.add_argument("--hf-batch", type=int, default=16)
    parser.add_argument("--skip-hf", action="store_true")
    parser.add_argument("--max-num-batched-tokens", type=int, default=1024)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)

    from kvserve import LLM
    from kvserve.loader import default_model_path
    model_path = default_model_path()
    llm = LLM(model_path, dtype="float32", num_threads=args.threads, max_num_seqs=64,
              max_num_batched_tokens=args.max_num_batched_tokens)
    requests = make_workload(llm.tokenizer, args.requests, args.seed)
    bandwidth = measure_read_bandwidth()
    weight_bytes = llm.engine.decode_read_bytes          # what one decode step streams
    bound = bandwidth / weight_bytes
    bs1 = run_bs1(llm, requests[0][0][:128])
    ours, ours_s = run_kvserve(llm, requests)
    result = {
        "workload": {"requests": args.requests, "prompt_tokens": sum(len(p) for p, _ in requests),
                     "output_tokens": sum(n for _, n in requests), "seed": args.seed, "threads": args.threads},
        "kvserve_output_tokens_per_s": round(ours, 2), "kvserve_elapsed_s": round(ours_s, 2),
        "preemptions": llm.engine.scheduler.num_preemptions,
        "bs1_decode_tokens_per_s": round(bs1, 2),
        "read_bandwidth_gb_per_s": round(bandwidth / 1e9, 2),
        "decode_read_bytes": weight_bytes,
        "bs1_bound_tokens_per_s": round(bound, 2),
        "bs1_fraction_of_bound": round(bs1 / bound, 3),
    }
    del llm
    if not args.skip_hf:
        hf, hf_s = run_hf(model_path, requests, args.hf_batch)
        result.update({"hf_output_tokens_per_s": round(hf, 2), "hf_elapsed_s": round(hf_s, 2),
                       "hf_batch_size": args.hf_batch, "ratio_vs_hf": round(ours / hf, 3)})
    json.dump(result, sys.stdout, indent=2)
    print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
