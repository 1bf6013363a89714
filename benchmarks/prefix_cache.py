"""Prefix-cache benchmark on the offline engine: the same requests with the cache on and off.

1. Multi-turn chat: C concurrent conversations x T turns, each turn resending the whole
   history. Per turn: prompt tokens, prompt tokens computed (prompt - cached), the new
   tokens since the previous turn's prompt, and TTFT.
   Goals (issue 4): with the cache, computed <= new tokens + one block and turn-T TTFT
   <= 1.5x turn-1 TTFT; without it both grow with the history.
2. Shared system prompt (~1,000 tokens) + short questions at concurrency 16: TTFT p50 /
   p99 and throughput, on vs off. Goal: >= 3x lower TTFT p50 with the cache.

The engine is driven directly (``EngineCore.step``): TTFT runs from ``add_request`` to
the end of the step that produced the request's first token. "Off" runs opt every
request out of the cache (``use_prefix_cache=False``), which computes exactly what an
engine with the cache switched off computes. Multi-turn: each turn runs with the cache
on, then the very same prompts are replayed with it off (interleaved, so both see the
same machine load). Shared prefix: replies of 8-24 tokens and at most one new request
per step, so arrivals spread out as they would in a server instead of moving in
lock-step waves. Prints one JSON object.

    python benchmarks/prefix_cache.py [--threads 2] [--turns 16] [--shared-requests 48]
"""
from __future__ import annotations

import argparse
import inspect
import json
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path


from kvserve.builder import build_engine
from kvserve.engine.config import EngineConfig
from kvserve.engine.engine_core import EngineCore
from kvserve.engine.request import EngineRequest
from kvserve.sampling.params import SamplingParams

QUESTIONS = [
    "What does this function return when the input is empty?", "Can you make it faster?",
    "Explain the second step again, more simply.", "Which edge cases should I test?",
    "Rewrite it without recursion.", "What is its time complexity?", "Add type hints, please.",
    "Why would someone choose this design?", "Summarise our discussion so far.",
    "Give me a one-line docstring for it.", "What could go wrong with unicode input?",
    "How would you name this variable?", "Is there a standard library function for this?",
    "Translate the idea into plain English.", "What would a reviewer ask about it?",
    "Show a tiny usage example.",
]


@dataclass
class Request:
    prompt_token_ids: list[int]
    use_prefix_cache: bool
    request_id: str = ""
    submitted_s: float = 0.0
    ttft_s: float | None = None
    latency_s: float | None = None
    output_token_ids: list[int] = field(default_factory=list)
    num_cached_tokens: int = 0


def drive(engine: EngineCore, requests: list[Request], params: SamplingParams | list[SamplingParams],
          concurrency: int, admit_per_step: int | None = None) -> float:
    """Run ``requests`` keeping ``concurrency`` in flight (adding at most ``admit_per_step``
    a step); fills their timings and outputs. Returns the wall time."""
    params_list = params if isinstance(params, list) else [params] * len(requests)
    queue = list(zip(requests, params_list))
    live: dict[str, Request] = {}
    started = time.perf_counter()
    counter = 0
    while queue or live:
        added = 0
        while queue and len(live) < concurrency and (admit_per_step is None or added < admit_per_step):
            request, request_params = queue.pop(0)
            request.request_id = f"b{id(request)}-{counter}"
            counter += 1
            added += 1
            request.submitted_s = time.perf_counter()
            engine.add_request(EngineRequest(request.request_id, request.prompt_token_ids, request_params,
                                             use_prefix_cache=request.use_prefix_cache))
            live[request.request_id] = request
        updates = engine.step()
        now = time.perf_counter()
        for update in updates:
            request = live.get(update.request_id)
            if request is None:
                continue
            if request.ttft_s is None and update.new_token_ids:
                request.ttft_s = now - request.submitted_s
            request.output_token_ids += update.new_token_ids
            request.num_cached_tokens = update.num_cached_tokens
            if update.finish_reason is not None:
                request.latency_s = now - request.submitted_s
                del live[update.request_id]
    return time.perf_counter() - started


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q / 100 * (len(ordered) - 1))))]


def encode_chat(tokenizer, messages) -> list[int]:
    return tokenizer.encode(tokenizer.apply_chat_template(messages, add_generation_prompt=True),
                            add_special_tokens=False)


# ------------------------------------------------------------------ multi-turn
def multi_turn(engine, tokenizer, params, num_convs, num_turns) -> tuple[list[list[Request]], list[list[Request]]]:
    """Conversations grown turn by turn with the cache on, each turn replayed with it off;
    returns the requests per turn of both."""
    conversations = [[{"role": "system", "content": f"You are assistant number {c}. Answer briefly."}]
                     for c in range(num_convs)]
    on, off = [], []
    for turn in range(num_turns):
        requests = []
        for c, messages in enumerate(conversations):
            messages.append({"role": "user", "content": QUESTIONS[(turn + 3 * c) % len(QUESTIONS)]})
            requests.append(Request(encode_chat(tokenizer, messages), use_prefix_cache=True))
        drive(engine, requests, params, concurrency=num_convs)
        replay = [Request(r.prompt_token_ids, use_prefix_cache=False) for r in requests]
        drive(engine, replay, params, concurrency=num_convs)
        for messages, request in zip(conversations, requests):
            messages.append({"role": "assistant", "content": tokenizer.decode(request.output_token_ids)})
        on.append(requests)
        off.append(replay)
    return on, off


def turn_summary(per_turn: list[list[Request]], block_size: int) -> dict:
    rows = []
    previous = None
    for requests in per_turn:
        prompt = [len(r.prompt_token_ids) for r in requests]
        computed = [len(r.prompt_token_ids) - r.num_cached_tokens for r in requests]
        new = prompt if previous is None else [p - q for p, q in zip(prompt, previous)]
        rows.append({"prompt_tokens": statistics.mean(prompt), "computed_tokens": statistics.mean(computed),
                     "new_tokens": statistics.mean(new),
                     "max_computed_minus_new": max(c - n for c, n in zip(computed, new)),
                     "ttft_mean_s": statistics.mean(r.ttft_s for r in requests),
                     "ttft_p50_s": statistics.median(r.ttft_s for r in requests)})
        previous = prompt
    return {
        "per_turn": rows,
        "ttft_last_over_first": rows[-1]["ttft_p50_s"] / rows[0]["ttft_p50_s"],
        "computed_within_new_plus_block": all(r["max_computed_minus_new"] <= block_size for r in rows[1:]),
    }


def bench_multi_turn(engine, tokenizer, args) -> dict:
    params = SamplingParams(temperature=0, max_tokens=args.reply_tokens, ignore_eos=True)
    engine.reset_prefix_cache()
    on, off = multi_turn(engine, tokenizer, params, args.conversations, args.turns)
    same = all(a.output_token_ids == b.output_token_ids for x, y in zip(on, off) for a, b in zip(x, y))
    on_summary, off_summary = turn_summary(on, args.block_size), turn_summary(off, args.block_size)
    return {
        "conversations": args.conversations, "turns": args.turns, "reply_tokens": args.reply_tokens,
        "cache_on": on_summary, "cache_off": off_summary, "outputs_identical": same,
        "goal_on_ttft_last_le_1_5x_first": on_summary["ttft_last_over_first"] <= 1.5,
        "goal_on_computed_within_new_plus_block": on_summary["computed_within_new_plus_block"],
        "total_prompt_tokens_computed": {
            "cache_on": sum(len(r.prompt_token_ids) - r.num_cached_tokens for t in on for r in t),
            "cache_off": sum(len(r.prompt_token_ids) for t in off for r in t)},
    }


# --------------------------------------------------------------- shared prefix
def bench_shared_prefix(engine, tokenizer, args) -> dict:
    import textwrap
    source = tokenizer.encode(inspect.getsource(textwrap), add_special_tokens=False)
    system = "You are a code assistant. Here is the file we discuss:\n" + tokenizer.decode(
        source[:args.system_tokens])
    params = [SamplingParams(temperature=0, max_tokens=8 + (7 * i) % 17, ignore_eos=True)
              for i in range(args.shared_requests)]
    prompts = [encode_chat(tokenizer, [{"role": "system", "content": system},
                                       {"role": "user", "content": f"{QUESTIONS[i % len(QUESTIONS)]} (#{i})"}])
               for i in range(args.shared_requests)]
    result = {"requests": len(prompts), "concurrency": args.concurrency,
              "mean_prompt_tokens": statistics.mean(len(p) for p in prompts)}
    for name, use in (("cache_off", False), ("cache_on", True)):
        engine.reset_prefix_cache()
        requests = [Request(p, use_prefix_cache=use) for p in prompts]
        wall = drive(engine, requests, params, concurrency=args.concurrency, admit_per_step=1)
        ttfts = [r.ttft_s for r in requests]
        result[name] = {"ttft_p50_s": statistics.median(ttfts), "ttft_p99_s": percentile(ttfts, 99),
                        "wall_s": wall, "requests_per_s": len(requests) / wall,
                        "output_tokens_per_s": sum(len(r.output_token_ids) for r in requests) / wall,
                        "cached_tokens_mean": statistics.mean(r.num_cached_tokens for r in requests)}
    on, off = result["cache_on"], result["cache_off"]
    result["ttft_p50_off_over_on"] = off["ttft_p50_s"] / on["ttft_p50_s"]
    result["ttft_p99_off_over_on"] = off["ttft_p99_s"] / on["ttft_p99_s"]
    result["throughput_on_over_off"] = on["output_tokens_per_s"] / off["output_tokens_per_s"]
    result["goal_ttft_p50_3x_lower"] = result["ttft_p50_off_over_on"] >= 3.0
    return result


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--kv-cache-gib", type=float, default=1.0)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--max-num-batched-tokens", type=int, default=1024)
    p.add_argument("--conversations", type=int, default=8)
    p.add_argument("--turns", type=int, default=16)
    p.add_argument("--reply-tokens", type=int, default=16)
    p.add_argument("--system-tokens", type=int, default=1000)
    p.add_argument("--shared-requests", type=int, default=48)
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--skip", choices=("multi-turn", "shared-prefix"), action="append", default=[])
    args = p.parse_args(argv)

    from kvserve.loader import load_checkpoint, resolve_model_path
    from kvserve.tokenizer import Tokenizer
    path = resolve_model_path(args.model)
    config = EngineConfig(model=path, dtype="float32", kv_cache_bytes=int(args.kv_cache_gib * 2**30),
                          block_size=args.block_size, num_threads=args.threads,
                          max_num_batched_tokens=args.max_num_batched_tokens)
    engine = build_engine(config, load_checkpoint(path))
    tokenizer = Tokenizer.load(path)
    warm = [Request(list(range(100, 164)), use_prefix_cache=False) for _ in range(4)]
    drive(engine, warm, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), concurrency=4)
    report = {"model": Path(path).name, "device": str(engine.device), "threads": args.threads,
              "block_size": args.block_size, "max_num_batched_tokens": args.max_num_batched_tokens}
    if "multi-turn" not in args.skip:
        report["multi_turn"] = bench_multi_turn(engine, tokenizer, args)
    if "shared-prefix" not in args.skip:
        report["shared_prefix"] = bench_shared_prefix(engine, tokenizer, args)
    engine.check_integrity()
    report["engine_stats"] = engine.stats().to_dict()
    print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
