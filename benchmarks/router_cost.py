"""The router's own cost: decision time of each policy with 1,000 cached conversations.

Three replicas; 1,000 conversations (8 shared system prompts of ~200 tokens, 8 turns of
~64 tokens each) already placed, their blocks in the KV-aware index as the replicas'
cache events would put them (and in prefix_approx's history by its own choices). Then
each policy places the next turn of every conversation (prompts of ~750 tokens, so ~47
block hashes each) and every decision is timed: hashing the request's blocks, scoring
every replica, choosing. Pure Python, one process; no engine runs.

    .venv/bin/python benchmarks/router_cost.py [--conversations 1000] [--out benchmarks/router_cost.json]
"""
from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.bench_host import emit, machine  # noqa: E402
from kvserve.engine.kv.cache_events import CacheNamespace  # noqa: E402
from kvserve.router import POLICIES, ReplicaState, RouteRequest, make_policy, request_block_hashes  # noqa: E402

BLOCK_SIZE = 16
REPLICAS = ("r0", "r1", "r2")
NAMESPACE = CacheNamespace(cache_salt="tenant:bench")


def conversations(count: int, turns: int, seed: int) -> list[list[int]]:
    """Each conversation's prompt tokens after ``turns`` turns (a shared system prompt first)."""
    rng = random.Random(seed)
    systems = [[rng.randrange(49152) for _ in range(200)] for _ in range(8)]
    return [systems[i % len(systems)] + [rng.randrange(49152) for _ in range(64 * turns)] for i in range(count)]


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def measure(name: str, history: list[list[int]], next_turns: list[list[int]]) -> dict:
    """Place every conversation's history (warm-up), then time placing each next turn."""
    policy = make_policy(name, block_size=BLOCK_SIZE)
    replicas = [ReplicaState(r, num_running=4, max_num_seqs=16) for r in REPLICAS]
    for i, tokens in enumerate(history):
        decision = policy.choose(replicas, RouteRequest(tuple(tokens), NAMESPACE, f"conv-{i}"))
        if name == "kv_aware":       # what the replica's BlockStored events would report
            policy.index.record(decision.replica, request_block_hashes(tokens, NAMESPACE, BLOCK_SIZE))
    times_us, hits = [], 0
    for i, tokens in enumerate(next_turns):
        started = time.perf_counter()
        decision = policy.choose(replicas, RouteRequest(tuple(tokens), NAMESPACE, f"conv-{i}"))
        times_us.append((time.perf_counter() - started) * 1e6)
        hits += decision.matched_blocks
    blocks = sum(len(t) // BLOCK_SIZE for t in next_turns)
    return {"policy": name, "decisions": len(times_us), "p50_us": round(percentile(times_us, 0.5), 1),
            "p99_us": round(percentile(times_us, 0.99), 1), "max_us": round(max(times_us), 1),
            "cached_block_fraction": round(hits / blocks, 3)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--conversations", type=int, default=1000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    full = conversations(args.conversations, 9, args.seed)
    history = [tokens[:-64] for tokens in full]            # 8 turns placed
    hashes = sum(len(t) // BLOCK_SIZE for t in full)
    report = {"benchmark": "router_cost", "machine": machine(), "replicas": len(REPLICAS),
              "conversations": args.conversations, "block_size": BLOCK_SIZE,
              "mean_prompt_tokens": round(sum(map(len, full)) / len(full), 1),
              "mean_blocks_per_request": round(hashes / len(full), 1),
              "policies": [measure(name, history, full) for name in POLICIES]}
    emit(report, args.out)


if __name__ == "__main__":
    main()
