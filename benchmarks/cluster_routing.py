"""Routing policies on a 2-replica cluster, same multi-turn chats: prefix-cached fraction of
prompt tokens, prompt tokens computed, TTFT p50/p99 — for round_robin, least_loaded,
prefix_approx and kv_aware, and a single server with twice the KV (one replica holding
everything) as the cached-fraction baseline. Each conversation's turns are paragraphs of
their own under one of 4 shared system prompts, so 8 live conversations' histories fill a
replica's KV when every replica holds all of them (round robin) and fit when each holds
its own half. Loopback only; every run on a fresh cluster.

    .venv/bin/python benchmarks/cluster_routing.py [--conversations 32 --turns 8] [--out benchmarks/cluster_routing.json]
"""
from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import httpx  # noqa: E402

from benchmarks.bench_host import emit, machine  # noqa: E402
from benchmarks.server_process import ServerProcess  # noqa: E402

MODEL = "SmolLM2-135M-Instruct"
POLICIES = ("round_robin", "least_loaded", "prefix_approx", "kv_aware")
TOPICS = ("the history of European railways", "growing vegetables on a balcony", "the physics of bicycles",
          "writing clear commit messages")


def system_prompts(count: int, words: int, seed: int) -> list[str]:
    """Shared system prompts (one per topic), long enough to matter for the cache."""
    rng = random.Random(seed)
    vocab = "answer briefly precisely politely clearly always never explain cite example detail note rule".split()
    return [f"You are an assistant for {TOPICS[i % len(TOPICS)]}. " + " ".join(rng.choice(vocab) for _ in range(words))
            for i in range(count)]


def user_message(index: int, turn: int, words: int, seed: int) -> str:
    """A turn of its own (a pasted paragraph, say): what makes each conversation's history unique."""
    rng = random.Random(f"{seed}:{index}:{turn}")
    vocab = ("train station garden tomato wheel gear commit branch river bridge winter summer market "
             "letter window engine signal timber copper harbour").split()
    return f"Question {turn} of conversation {index}: " + " ".join(rng.choice(vocab) for _ in range(words))


async def conversation(client: httpx.AsyncClient, url: str, system: str, index: int, records: list, args) -> None:
    turns, max_tokens = args.turns, args.max_tokens
    messages = [{"role": "system", "content": system}]
    for turn in range(turns):
        messages.append({"role": "user", "content": user_message(index, turn, args.user_words, args.seed)})
        body = {"model": MODEL, "messages": messages, "max_tokens": max_tokens, "temperature": 0, "stream": True,
                "stream_options": {"include_usage": True}}
        started, first, text, usage = time.perf_counter(), None, "", None
        async with client.stream("POST", url, json=body) as r:
            replica = r.headers.get("x-kvserve-replica")
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if chunk.get("usage"):
                    usage = chunk["usage"]
                for choice in chunk.get("choices", []):
                    if choice["delta"].get("content"):
                        first = first or time.perf_counter()
                        text += choice["delta"]["content"]
        records.append({"ttft_s": (first or time.perf_counter()) - started, "prompt_tokens": usage["prompt_tokens"],
                        "cached_tokens": usage["prompt_tokens_details"]["cached_tokens"], "replica": replica})
        messages.append({"role": "assistant", "content": text})


async def drive(base_url: str, args) -> tuple[list, float]:
    systems = system_prompts(len(TOPICS), args.system_words, args.seed)
    records: list = []
    semaphore = asyncio.Semaphore(args.concurrency)

    async def one(i: int) -> None:
        async with semaphore:
            await conversation(client, base_url + "/chat/completions", systems[i % len(systems)], i, records, args)
    started = time.perf_counter()
    async with httpx.AsyncClient(timeout=600) as client:
        await asyncio.gather(*(one(i) for i in range(args.conversations)))
    return records, time.perf_counter() - started


def summarise(name: str, records: list, seconds: float) -> dict:
    ttfts = sorted(r["ttft_s"] for r in records)
    prompt = sum(r["prompt_tokens"] for r in records)
    cached = sum(r["cached_tokens"] for r in records)
    replicas: dict = {}
    for r in records:
        replicas[r["replica"]] = replicas.get(r["replica"], 0) + 1
    return {"setting": name, "requests": len(records), "seconds": round(seconds, 1), "prompt_tokens": prompt,
            "cached_tokens": cached, "cached_fraction": round(cached / prompt, 3), "computed_tokens": prompt - cached,
            "ttft_p50_s": round(ttfts[len(ttfts) // 2], 3), "ttft_p99_s": round(ttfts[int(0.99 * (len(ttfts) - 1))], 3),
            "requests_per_replica": sorted(replicas.values(), reverse=True)}


def run_one(name: str, command: tuple, flags: list[str], args) -> dict:
    with ServerProcess(*flags, command=command, startup_timeout_s=600) as server:
        records, seconds = asyncio.run(drive(server.base_url, args))
    result = summarise(name, records, seconds)
    print(json.dumps(result), flush=True)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--conversations", type=int, default=32)
    parser.add_argument("--turns", type=int, default=8)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--system-words", type=int, default=150)
    parser.add_argument("--user-words", type=int, default=20, help="words per user turn, unique to its conversation")
    parser.add_argument("--kv-cache-gib", type=float, default=0.25, help="per replica; the single server gets 2x")
    parser.add_argument("--policies", default=",".join(POLICIES), help="comma-separated (ratios need round_robin "
                        "and kv_aware)")
    parser.add_argument("--single", action=argparse.BooleanOptionalAction, default=True,
                        help="also run the single-server baseline")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    common = ["--threads", "1", "--dtype", "float32", "--max-num-seqs", "8"]
    results = [run_one("single_server_2x_kv", ("serve",), [*common, "--kv-cache-gib", str(2 * args.kv_cache_gib)],
                       args)] if args.single else []
    for policy in args.policies.split(","):
        results.append(run_one(policy, ("cluster", "serve"), [*common, "--kv-cache-gib", str(args.kv_cache_gib),
                                                                "--replicas", "2", "--router", policy], args))
    report = {"benchmark": "cluster_routing", "machine": machine(), "settings": vars(args), "results": results,
              "ratios": ratios({r["setting"]: r for r in results})}
    emit(report, args.out)


def ratios(by_name: dict) -> dict:
    """kv_aware against the goals' baselines (those of them that ran)."""
    kv, rr, single = by_name.get("kv_aware"), by_name.get("round_robin"), by_name.get("single_server_2x_kv")
    out = {}
    if kv and single:
        out["kv_aware_cached_fraction_vs_single"] = round(kv["cached_fraction"] / single["cached_fraction"], 3)
    if kv and rr:
        out["kv_aware_computed_tokens_vs_round_robin"] = round(kv["computed_tokens"] / rr["computed_tokens"], 3)
        out["kv_aware_ttft_p50_vs_round_robin"] = round(kv["ttft_p50_s"] / rr["ttft_p50_s"], 3)
    return out


if __name__ == "__main__":
    main()
