"""Routing policies on a 2-replica cluster, same multi-turn chats: prefix-cached fraction of
prompt tokens, prompt tokens computed, TTFT p50/p99 — for round_robin, least_loaded,
prefix_approx and kv_aware, and a single server with twice the KV (one replica holding
everything) as the cached-fraction baseline. Loopback only; every run on a fresh cluster.

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


async def conversation(client: httpx.AsyncClient, url: str, system: str, index: int, turns: int, records: list,
                       max_tokens: int) -> None:
    messages = [{"role": "system", "content": system}]
    for turn in range(turns):
        messages.append({"role": "user", "content": f"Question {turn} of conversation {index}: tell me one fact."})
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
            await conversation(client, base_url + "/chat/completions", systems[i % len(systems)], i, args.turns,
                               records, args.max_tokens)
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
    parser.add_argument("--max-tokens", type=int, default=12)
    parser.add_argument("--system-words", type=int, default=150)
    parser.add_argument("--kv-cache-gib", type=float, default=0.25, help="per replica; the single server gets 2x")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    common = ["--threads", "1", "--dtype", "float32", "--max-num-seqs", "8"]
    results = [run_one("single_server_2x_kv", ("serve",), [*common, "--kv-cache-gib", str(2 * args.kv_cache_gib)],
                       args)]
    for policy in POLICIES:
        results.append(run_one(policy, ("cluster", "serve"), [*common, "--kv-cache-gib", str(args.kv_cache_gib),
                                                                "--replicas", "2", "--router", policy], args))
    by_name = {r["setting"]: r for r in results}
    rr, single, kv = by_name["round_robin"], by_name["single_server_2x_kv"], by_name["kv_aware"]
    report = {"benchmark": "cluster_routing", "machine": machine(), "settings": vars(args), "results": results,
              "ratios": {"kv_aware_cached_fraction_vs_single": round(kv["cached_fraction"] / single["cached_fraction"], 3),
                         "kv_aware_computed_tokens_vs_round_robin": round(kv["computed_tokens"] / rr["computed_tokens"], 3),
                         "kv_aware_ttft_p50_vs_round_robin": round(kv["ttft_p50_s"] / rr["ttft_p50_s"], 3)}}
    emit(report, args.out)


if __name__ == "__main__":
    main()
