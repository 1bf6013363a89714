"""Tier 1: the radix prefix cache and its block-pool accounting (no model, no torch).

Block size 2 throughout, so a block is a pair of tokens. "Computing" a run of blocks
is simulated by allocating them from the pool; a finished sequence frees its own
references, leaving the cache's one (cached-only blocks).
"""
import pytest

from kvserve.engine.kv.block_pool import BlockPool
from kvserve.engine.kv.prefix_cache import PrefixCache
from kvserve.engine.kv.cache_events import BlockRemoved, BlockStored, CacheNamespace, block_hash, namespace_seed

NS = CacheNamespace()


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


class World:
    """A pool, a cache, and the tables / locked handles of pretend sequences."""

    def __init__(self, num_blocks=16, block_size=2):
        self.pool = BlockPool(num_blocks, block_size)
        self.clock = Clock()
        self.cache = PrefixCache(self.pool, clock=self.clock)
        self.tables: dict[str, list[int]] = {}
        self.handles: dict[str, object] = {}

    def run(self, name, tokens, namespace=NS, keep=False):
        """A sequence over ``tokens`` (whole blocks): match, share the hit, compute the
        rest into new blocks, insert them. Keeps running (locked) if ``keep``."""
        bs = self.pool.block_size
        handle = self.cache.match(namespace, tokens, max_tokens=len(tokens))
        self.cache.lock(handle)
        table = list(handle.block_ids)
        self.pool.share(table)
        table += self.pool.allocate(len(tokens) // bs - len(table))
        new = self.cache.insert(handle, tokens[handle.num_tokens:], table[handle.num_blocks:])
        self.cache.lock(new)
        self.cache.unlock(handle)
        self.tables[name], self.handles[name] = table, new
        self.check()
        if not keep:
            self.finish(name)
        return table

    def finish(self, name, grace_s=0.0):
        self.cache.unlock(self.handles.pop(name), grace_s)
        self.pool.free(self.tables.pop(name))
        self.check()

    def check(self):
        self.pool.check_integrity(list(self.tables.values()))
        self.cache.check_integrity(self.handles.values())
        pool = self.pool
        assert pool.num_free_blocks + pool.num_cached_only_blocks + pool.num_used_blocks == pool.num_blocks


def toks(*pairs):
    return [t for p in pairs for t in p]


A, B, C, D, E, F = (1, 2), (3, 4), (5, 6), (7, 8), (9, 10), (11, 12)


def test_insert_then_match_whole_blocks_capped():
    w = World()
    assert w.run("s", toks(A, B, C)) == [0, 1, 2]
    assert (w.pool.num_free_blocks, w.pool.num_cached_only_blocks, w.pool.num_used_blocks) == (13, 3, 0)
    assert w.cache.match(NS, toks(A, B, C)).block_ids == (0, 1, 2)
    assert w.cache.match(NS, toks(A, B, C), max_tokens=5).block_ids == (0, 1)     # last token computed
    assert w.cache.match(NS, toks(A, B, C) + [99]).block_ids == (0, 1, 2)
    assert w.cache.match(NS, toks(A, (3, 99), C)).block_ids == (0,)                # diverges inside block 1
    assert w.cache.match(NS, [1]).block_ids == ()                                  # no full block
    assert w.cache.match(CacheNamespace(cache_salt="t2"), toks(A, B, C)).block_ids == ()
    w.check()


def test_match_ending_inside_a_node_splits_it():
    w = World()
    w.run("s", toks(A, B, C, D))
    assert w.cache.stats().num_nodes == 1
    handle = w.cache.match(NS, toks(A, B, E))
    assert handle.block_ids == (0, 1) and handle.num_tokens == 4
    assert w.cache.stats().num_nodes == 2                      # [A B] -> [C D]
    w.check()
    assert w.run("edit", toks(A, B, E, F)) == [0, 1, 4, 5]     # branch: [A B] -> {[C D], [E F]}
    assert w.cache.stats().num_nodes == 3
    assert w.cache.match(NS, toks(A, B, C, D)).block_ids == (0, 1, 2, 3)
    assert w.cache.match(NS, toks(A, B, E, F)).block_ids == (0, 1, 4, 5)


def test_already_cached_blocks_are_skipped_on_insert():
    w = World()
    first = w.run("first", toks(A, B), keep=True)
    # A second sequence computed the same tokens into its own blocks before the first inserted.
    own = w.pool.allocate(3)
    handle = w.cache.match(NS, [], max_tokens=0)
    new = w.cache.insert(handle, toks(A, B, C), own)
    assert first == [0, 1] and own == [2, 3, 4]
    assert new.block_ids == (0, 1, 4)                          # its copies of A B stay its own
    assert [w.pool.is_cached(b) for b in range(5)] == [True, True, False, False, True]
    w.cache.lock(new)
    w.tables["second"], w.handles["second"] = own, new
    w.check()
    w.finish("second")
    w.finish("first")
    assert w.pool.num_free_blocks == 16 - 3


def test_lru_evicts_unlocked_leaves_tail_first():
    w = World()
    w.run("x", toks(A, B, C))          # [0 1 2]
    w.run("y", toks(D, E))             # [3 4]
    w.run("z", toks(A, B, F))          # [0 1] hit, [5] new: x splits into [A B] -> {[C], [F]}
    w.cache.match(NS, toks(D, E, A))   # touch y: now x's [C] is the least recently used leaf
    assert w.cache.evict(1) == [2]
    w.check()
    assert w.cache.evict(2) == [5, 1]  # z's leaf, then its parent [A B] became a leaf: tail first
    w.check()
    assert w.cache.evict(10) == [0, 4, 3]
    w.check()
    assert w.cache.evict(1) == []
    assert w.pool.num_free_blocks == 16 and w.cache.stats().num_evicted_blocks == 6


def test_locked_handles_and_grace_time_protect_blocks():
    w = World()
    w.run("running", toks(A, B), keep=True)            # [0 1], locked
    w.run("done", toks(C, D), keep=True)               # [2 3]
    w.finish("done", grace_s=10.0)                     # a live turn: protected 10 s
    w.run("old", toks(E))                              # [4]
    assert w.cache.evict(16) == [4]
    w.check()
    w.clock.now = 9.9
    assert w.cache.evict(16) == []
    w.clock.now = 10.0
    assert w.cache.evict(16) == [3, 2]
    w.finish("running")
    assert w.cache.evict(16) == [1, 0]
    w.check()


def test_grace_protects_at_most_its_share_of_the_pool():
    w = World(num_blocks=8)                            # max_protected_share 0.5: 4 blocks
    assert w.cache.max_protected_blocks == 4
    for name, tokens in (("a", toks(A, B)), ("b", toks(C, D)), ("c", toks(E, F))):
        w.run(name, tokens, keep=True)
        w.finish(name, grace_s=10.0)
    assert w.cache.num_protected_blocks() == 6
    assert w.cache.evict(16) == [1, 0]                 # the least recently used beyond the share
    assert w.cache.num_protected_blocks() == 4
    assert w.cache.evict(16) == []                     # within the share: grace holds
    assert sorted(w.cache.evict(16, include_protected=True)) == [2, 3, 4, 5]
    w.check()


def _grow(w, name, more):
    """``name`` computes ``more`` tokens and inserts them as the engine does: a child node of
    its prompt's node, its lock moving down."""
    old = w.handles[name]
    blocks = w.pool.allocate(len(more) // w.pool.block_size)
    w.tables[name] += blocks
    new = w.cache.insert(old, more, blocks)
    w.cache.lock(new)
    w.cache.unlock(old)
    w.handles[name] = new


def test_grace_counts_the_chain_a_protected_node_pins():
    # A finished request's prompt and output are two nodes, [A B] -> [C D]; grace marks the
    # output's node, and since only leaves are evicted it pins the prompt's too. Counting the
    # leaf alone (2 blocks each) let three such chains (12 blocks) pass a 4-block share: a
    # 0.05 GiB server pool at 1.5 req/s then admitted one request at a time (TTFT p50 10.5 s).
    w = World(num_blocks=12)                           # max_protected_share 0.5: 6 blocks
    for name, prompt, output in (("a", toks(A, B), toks(C, D)), ("b", toks(E, F), toks(A, C)),
                                 ("c", toks(D, E), toks(F, A))):
        w.run(name, prompt, keep=True)
        _grow(w, name, output)
        w.finish(name, grace_s=10.0)
    assert w.cache.stats().num_nodes == 6
    assert w.cache.num_protected_blocks() == 12
    # beyond the share, least recently used first: a's chain, then b's output (tail first)
    assert sorted(w.cache.evict(16)) == [0, 1, 2, 3, 6, 7]
    assert w.cache.num_protected_blocks() == 4                # c's chain; b's prompt is no longer pinned
    assert w.cache.evict(16) == [5, 4]                        # so it goes like any unprotected block
    assert w.cache.evict(16) == []                            # within the share: grace holds
    w.run("d", toks(B, C), keep=True)                  # a running request's lock holds its own blocks
    assert w.cache.num_protected_blocks() == 4
    w.check()


def test_lock_on_a_prefix_keeps_the_path_and_lets_children_go():
    w = World()
    w.run("long", toks(A, B, C, D))                    # [0 1 2 3]
    handle = w.cache.match(NS, toks(A, B, F))          # splits; handle ends at [A B]
    w.cache.lock(handle)
    assert w.cache.evict(16) == [3, 2]
    w.cache.check_integrity([handle])
    w.cache.unlock(handle)
    assert w.cache.evict(16) == [1, 0]
    w.check()
    with pytest.raises(RuntimeError):
        w.cache.unlock(handle)                         # more unlocks than locks


def test_cow_branches_share_cached_blocks():
    # Two branches of one conversation (n > 1 or an edited re-send) share the common blocks.
    w = World()
    trunk = w.run("trunk", toks(A, B), keep=True)
    left = w.run("left", toks(A, B, C), keep=True)
    right = w.run("right", toks(A, B, D), keep=True)
    assert trunk == [0, 1] and left == [0, 1, 2] and right == [0, 1, 3]
    assert [w.pool.ref_count(b) for b in range(4)] == [4, 4, 2, 2]   # 3 sequences + the cache
    w.finish("trunk")
    w.finish("left")
    assert w.cache.evict(16) == [2]                    # right still locks [A B] -> [D]
    w.finish("right")
    assert w.cache.evict(16) == [3, 1, 0]
    w.check()


def test_reset_and_retired_epochs():
    w = World()
    old = CacheNamespace(weight_epoch=0)
    new = CacheNamespace(weight_epoch=1)
    w.run("a", toks(A, B), namespace=old)              # [0 1]
    w.run("b", toks(A, B), namespace=new)              # [2 3]: another epoch never shares
    w.run("c", toks(C), namespace=old, keep=True)      # [4] locked
    assert w.cache.cached_block_ids(old) == {0, 1, 4} and w.cache.cached_block_ids(new) == {2, 3}
    assert sorted(w.cache.evict_namespaces(lambda ns: ns.weight_epoch < 1)) == [0, 1]
    assert w.cache.match(old, toks(A, B)).block_ids == ()
    w.check()
    assert w.cache.reset() == 2                        # [2 3]; [4] is locked
    w.finish("c")
    assert w.cache.reset() == 1
    assert w.pool.num_free_blocks == 16
    w.check()


def test_events_chain_hashes_within_a_namespace():
    w = World()
    w.run("s", toks(A, B))
    w.run("t", toks(A, B, C))
    w.cache.evict(1)
    events = w.cache.drain_events()
    h_a = block_hash(namespace_seed(NS), list(A))
    h_b = block_hash(h_a, list(B))
    h_c = block_hash(h_b, list(C))
    assert events == [BlockStored([h_a, h_b], None, toks(A, B), 2, None),
                      BlockStored([h_c], h_b, list(C), 2, None),
                      BlockRemoved([h_c])]
    assert w.cache.drain_events() == []
    assert block_hash(namespace_seed(CacheNamespace(cache_salt="x")), list(A)) != h_a


def test_stats_and_bad_inserts():
    w = World()
    w.cache.record_query(10, 4)
    w.cache.record_query(6, 0)
    stats = w.cache.stats()
    assert (stats.num_queries, stats.num_query_tokens, stats.num_hit_tokens) == (2, 16, 4)
    assert stats.hit_rate == 0.25
    handle = w.cache.match(NS, [])
    with pytest.raises(ValueError):
        w.cache.insert(handle, [1, 2, 3], w.pool.allocate(2))
    with pytest.raises(RuntimeError):
        w.pool.cache_blocks([15])                      # a free block cannot be cached


def test_generate_cli_accepts_no_prefix_cache():
    import argparse

    from kvserve.frontend.generate_cli import register
    parser = argparse.ArgumentParser()
    register(parser.add_subparsers(dest="command"))
    assert parser.parse_args(["generate", "--prompt", "hi"]).prefix_cache is True
    assert parser.parse_args(["generate", "--prompt", "hi", "--no-prefix-cache"]).prefix_cache is False


def test_largest_subtrees_count_each_top_level_branch():
    w = World(num_blocks=32)
    bob = CacheNamespace(cache_salt="tenant:bob")
    w.run("a1", toks(A, B, C, D))
    w.run("a2", toks(A, B, E, F))                  # [A B] -> {[C D], [E F]}: one branch, two leaves
    w.run("c", toks(C, D))
    w.run("bob", toks(A), namespace=bob, keep=True)
    top = w.cache.largest_subtrees(limit=2)
    assert [(t.cache_salt, t.num_blocks, t.num_leaves, t.num_locked_blocks) for t in top] == [
        (None, 4 + 2, 2, 0), (None, 2, 1, 0)]
    everything = w.cache.largest_subtrees(limit=10)
    assert (everything[-1].cache_salt, everything[-1].num_blocks, everything[-1].num_locked_blocks) == ("tenant:bob", 1, 1)
    assert sum(t.num_blocks for t in everything) == w.cache.num_cached_blocks


def _least_recent_evictable_leaf(cache, now):
    leaves = [n for n in cache._leaves if n.lock_count == 0 and n.protected_until <= now]
    return min(leaves, key=lambda n: (n.last_access, n.serial), default=None)


def test_eviction_follows_lru_through_random_traffic_and_its_heap_stays_bounded():
    """The LRU heap (pushed on every touch, stale entries skipped) against the rule it
    implements: each eviction starts at the least recently used unlocked leaf out of grace,
    over seeded random runs, locks, touches, graces and evictions; integrity (every leaf on the
    heap at its last use) after each step, and stale entries never outnumber the leaves for long."""
    import random
    rng = random.Random(7)
    w = World(num_blocks=64)
    pairs = [(i, i + 1) for i in range(1, 13, 2)]
    for step in range(600):
        op = rng.random()
        if op < 0.45 and w.pool.num_free_blocks >= 6:
            tokens = toks(*[rng.choice(pairs[:3] if i < 2 else pairs) for i in range(rng.randint(1, 5))])
            w.run(f"s{step}", tokens, keep=rng.random() < 0.3)
        elif op < 0.6 and w.handles:
            w.finish(rng.choice(sorted(w.handles)), grace_s=rng.choice([0.0, 0.0, 2.0]))
        elif op < 0.75:
            w.cache.match(NS, toks(*[rng.choice(pairs) for _ in range(rng.randint(1, 4))]))
            w.check()
        elif op < 0.9:
            everything = rng.random() < 0.2                    # the escape hatch: grace ignored
            out_of_grace = _least_recent_evictable_leaf(w.cache, w.clock.now)
            unlocked = _least_recent_evictable_leaf(w.cache, float("inf"))
            first = out_of_grace.block_ids[-1] if out_of_grace is not None else None
            oldest = unlocked.block_ids[-1] if unlocked is not None else None
            dropped = w.cache.evict(rng.randint(1, 4), include_protected=everything)
            if first is not None:
                assert dropped[0] == first
            elif dropped:                                      # grace given up: the oldest graced leaf first
                assert dropped[0] == oldest
            if everything:
                assert bool(dropped) == (oldest is not None)
            w.check()
        else:
            w.clock.now += 1.0
        queue = w.cache._queue
        assert len(queue.lru) + len(queue.graced) <= 2 * len(w.cache._leaves) + 64
    assert w.cache.stats().num_evicted_blocks > 50
