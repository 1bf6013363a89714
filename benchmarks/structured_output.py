"""Structured output overhead: output tokens/s under a JSON schema vs unconstrained, on the
offline engine (``LLM``, in-process: the grammar work is all engine-side), and grammar
compile times.

Same requests both ways: each request runs first under its JSON schema (22 schemas from
tests/support/json_schemas.py, greedy); the unconstrained run then generates exactly as
many tokens for the same prompt (``max_tokens`` = the constrained length, ``ignore_eos``),
so both runs do the same forward work and differ only by the masks. Concurrency 1 runs
the requests one after another; concurrency 16 submits 16 at once. Compile times: each
schema compiled once on a fresh compiler (cache misses), p50 / p99.

    .venv/bin/python benchmarks/structured_output.py [--threads 1] [--out benchmarks/structured_output.json]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from kvserve import LLM, SamplingParams  # noqa: E402
from kvserve.engine.structured_spec import StructuredKind, StructuredSpec  # noqa: E402
from tests.support.json_schemas import SCHEMAS  # noqa: E402

PROMPTS = ["Reply with a JSON object that fits the task.", "Describe something in your favourite city as JSON.",
           "Make up a small record for a database, in JSON.", "Give me an example as JSON."]


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]


def run(llm, prompts, params, specs, concurrency: int) -> tuple[list, float]:
    """Outputs and wall seconds, ``concurrency`` requests per generate call."""
    outs, started = [], time.perf_counter()
    for i in range(0, len(prompts), concurrency):     # each call drains before the next starts
        outs += llm.generate(prompts[i:i + concurrency], params[i:i + concurrency], structured=specs[i:i + concurrency])
    return outs, time.perf_counter() - started


def measure(llm, concurrency: int, num_requests: int) -> dict:
    names = [list(SCHEMAS)[i % len(SCHEMAS)] for i in range(num_requests)]
    prompts = [[{"role": "user", "content": PROMPTS[i % len(PROMPTS)]}] for i in range(num_requests)]
    specs = [StructuredSpec(StructuredKind.JSON_SCHEMA, json.dumps(SCHEMAS[n])) for n in names]
    greedy = [SamplingParams(max_tokens=96, temperature=0)] * num_requests
    run(llm, prompts[:concurrency], greedy[:concurrency], specs[:concurrency], concurrency)     # warm-up
    tracker = llm.engine.constraints
    mask_s, mask_steps = tracker.mask_seconds, tracker.mask_steps
    constrained, t_constrained = run(llm, prompts, greedy, specs, concurrency)
    mask_ms = 1e3 * (tracker.mask_seconds - mask_s) / max(1, tracker.mask_steps - mask_steps)
    lengths = [len(o.outputs[0].token_ids) for o in constrained]
    same_work = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for n in lengths]
    free, t_free = run(llm, prompts, same_work, [None] * num_requests, concurrency)
    tokens = sum(lengths)
    assert tokens == sum(len(o.outputs[0].token_ids) for o in free)
    stopped = sum(o.outputs[0].finish_reason == "stop" for o in constrained)
    print(f"concurrency {concurrency}: {tokens} tokens, {t_constrained:.1f} s constrained, {t_free:.1f} s free",
          file=sys.stderr, flush=True)
    return {"concurrency": concurrency, "requests": num_requests, "output_tokens": tokens,
            "constrained_tok_s": round(tokens / t_constrained, 1), "unconstrained_tok_s": round(tokens / t_free, 1),
            "ratio": round(t_free / t_constrained, 3), "ended_by_grammar": stopped,
            "mask_host_ms_per_step": round(mask_ms, 3), "step_ms_constrained": round(
                1e3 * t_constrained / max(1, tracker.mask_steps - mask_steps), 1)}


def compile_times(llm) -> dict:
    from kvserve.structured.compiler import GrammarCache
    cache = GrammarCache(llm.engine.constraints.backend.grammars.info)
    for schema in SCHEMAS.values():
        cache.get(StructuredSpec(StructuredKind.JSON_SCHEMA, json.dumps(schema)))
    ms = [t * 1e3 for t in cache.compile_times_s]
    print(f"compiled {len(ms)} schemas: {sum(ms) / 1e3:.1f} s", file=sys.stderr, flush=True)
    return {"schemas": len(ms), "p50_ms": round(statistics.median(ms), 2), "p99_ms": round(percentile(ms, 0.99), 2),
            "max_ms": round(max(ms), 2)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", default="benchmarks/structured_output.json")
    args = parser.parse_args()
    llm = LLM(dtype="float32", num_threads=args.threads, kv_cache_bytes=256 << 20, max_num_seqs=32)
    result = {"engine": "offline LLM (in-process EngineCore), SmolLM2-135M-Instruct fp32, "
                        f"{args.threads} threads, greedy, {os.cpu_count()} CPUs on the host",
              "compile": compile_times(llm),
              "runs": [measure(llm, 1, 6), measure(llm, 16, 16)]}
    text = json.dumps(result, indent=2)
    print(text)
    with open(args.out, "w") as f:
        f.write(text + "\n")


if __name__ == "__main__":
    main()
