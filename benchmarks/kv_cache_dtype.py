"""Decode step time per KV cache dtype (fp32 compute): 8 sequences x 512 tokens of context, 1 thread.

All engines live in one process and their decode steps are interleaved, so they see the
same machine load. Run: ``PYTHONPATH=. HF_HUB_OFFLINE=1 python benchmarks/kv_cache_dtype.py``.
"""
from __future__ import annotations

import random
import statistics
import time

import torch

from kvserve import LLM
from kvserve.engine.request import EngineRequest
from kvserve.sampling.params import SamplingParams

KV_DTYPES = ("float32", "int8", "fp8_e4m3", "fp8_e5m2")


def prefilled_engine(kv: str, prompts: list[list[int]]) -> LLM:
    """An engine with ``prompts`` prefilled (one step) and two warm decode steps done."""
    llm = LLM(dtype="float32", kv_cache_dtype=kv, kv_cache_bytes=256 * 2**20, num_threads=1,
              max_num_seqs=len(prompts), max_num_batched_tokens=4096, enable_prefix_cache=False)
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    for i, p in enumerate(prompts):
        llm.add_request(EngineRequest(f"{kv}-{i}", p, params, frozenset(llm.tokenizer.eos_token_ids)))
    for _ in range(3):
        llm.engine.step()
    return llm


def main(num_seqs: int = 8, context: int = 512, steps: int = 24) -> None:
    torch.set_num_threads(1)
    rng = random.Random(0)
    prompts = [[rng.randrange(100, 40000) for _ in range(context)] for _ in range(num_seqs)]
    engines = {kv: prefilled_engine(kv, prompts) for kv in KV_DTYPES}
    times: dict[str, list[float]] = {kv: [] for kv in engines}
    for _ in range(steps):
        for kv, llm in engines.items():
            started = time.perf_counter()
            llm.engine.step()
            times[kv].append(time.perf_counter() - started)
    for kv, ts in times.items():
        print(f"{kv:9s} decode step ({num_seqs} seqs, ~{context} ctx): median {statistics.median(ts) * 1e3:.1f} ms, "
              f"min {min(ts) * 1e3:.1f} ms over {len(ts)}")


if __name__ == "__main__":
    main()
