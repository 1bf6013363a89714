"""The prefix cache's eviction cost as the tree grows: one ``evict(1)`` (what an allocation on a
full pool asks for) on caches of 1,000 to 50,000 leaves, against the scan it replaced (every
leaf into a fresh heap per call, ``heapify`` included), timed on the same trees in the same run.

    .venv/bin/python benchmarks/prefix_cache_eviction.py [--out benchmarks/prefix_cache_eviction.json]

Each cache holds ``leaves`` sequences of 4 blocks of 16 tokens under 50 shared first blocks (a
system prompt each), every block cached and unlocked. Prints one JSON object: per size, the
microseconds of one eviction both ways and their ratio.

``graced``: the same caches with every sequence finished within its grace time (the server
keeps a finished request's blocks 30 s) and grace allowed the whole pool, so an eviction finds
nothing to drop, the case of a full pool under load where each admission attempt asks again.
The replaced code built its (empty) heap and walked the tree to count the protected blocks on
every such call; now the graced leaves are set apart once, and the walk is skipped (the cache
cannot exceed the share here; elsewhere its count is remembered until the tree changes).
"""
from __future__ import annotations

import argparse
import heapq
import json
import os
import random
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

BLOCK_SIZE, BLOCKS_PER_SEQ, SHARED_FIRSTS, EVICTIONS = 16, 4, 50, 200


def _filled_cache(leaves: int, grace_s: float = 0.0):
    from kvserve.engine.kv.block_pool import BlockPool
    from kvserve.engine.kv.cache_events import CacheNamespace
    from kvserve.engine.kv.prefix_cache import PrefixCache
    namespace, rng = CacheNamespace(), random.Random(0)
    pool = BlockPool(leaves * BLOCKS_PER_SEQ + SHARED_FIRSTS, BLOCK_SIZE)
    cache = PrefixCache(pool, max_protected_share=1.0 if grace_s else 0.5)
    for i in range(leaves):
        tokens = [i % SHARED_FIRSTS] * BLOCK_SIZE + [rng.randrange(32_000) for _ in range(BLOCK_SIZE * (BLOCKS_PER_SEQ - 1))]
        handle = cache.match(namespace, tokens)
        blocks = pool.allocate(BLOCKS_PER_SEQ - handle.num_blocks)
        new = cache.insert(handle, tokens[handle.num_tokens:], blocks)
        cache.lock(new)
        cache.unlock(new, grace_s)              # a finished request: its blocks kept grace_s
        pool.free(blocks)                       # the sequence ends: the cache's reference stays
    return cache


def _scan_us(cache, walk: bool = False) -> float:
    """The replaced rule's work per call: every evictable leaf into a new heap, then one pop; with
    ``walk``, the count of protected blocks by a walk of the tree too."""
    now = time.monotonic()
    t = time.perf_counter()
    for _ in range(EVICTIONS):
        heap = [(n.last_access, n.serial, n) for n in cache._leaves
                if not n.children and n.lock_count == 0 and n.protected_until <= now]
        heapq.heapify(heap)
        if heap:
            heapq.heappop(heap)
        if walk:
            cache._count_protected(now)
    return (time.perf_counter() - t) / EVICTIONS * 1e6


def _evict_us(cache) -> float:
    t = time.perf_counter()
    for _ in range(EVICTIONS):
        cache.evict(1)
    return (time.perf_counter() - t) / EVICTIONS * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    out = {"block_size": BLOCK_SIZE, "blocks_per_sequence": BLOCKS_PER_SEQ, "evictions_timed": EVICTIONS,
           "sizes": [], "graced": []}
    for leaves in (1_000, 10_000, 50_000):
        cache = _filled_cache(leaves)
        scan = _scan_us(cache)
        heap = _evict_us(cache)
        out["sizes"].append({"leaves": leaves, "cached_blocks": cache.num_cached_blocks + EVICTIONS,
                             "evict_us": round(heap, 2), "full_scan_us": round(scan, 1),
                             "scan_over_evict": round(scan / heap, 1)})
    for leaves in (1_000, 10_000):
        cache = _filled_cache(leaves, grace_s=3600.0)
        scan, heap = _scan_us(cache, walk=True), _evict_us(cache)
        out["graced"].append({"leaves": leaves, "evict_us": round(heap, 2), "scan_and_walk_us": round(scan, 1),
                              "old_over_new": round(scan / heap, 1)})
    text = json.dumps(out, indent=1)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
