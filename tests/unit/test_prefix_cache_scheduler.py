"""Tier 1: the scheduler with a prefix cache, driven by hand-built step results.

Block size 4, a fake clock, exact block ids. The pool's free list is FIFO: blocks
0, 1, 2, ... are handed out first and freed blocks go to its end.
"""
import pytest

from kvserve.engine.kv.cache_events import CacheNamespace
from tests.support.scheduler_harness import SchedulerHarness

NS = CacheNamespace()


class Harness(SchedulerHarness):
    """The shared harness with a prefix cache; ``namespace`` None opts a request out, and
    its adapter and salt become the request's (the weight epoch stays 0)."""

    def __init__(self, num_blocks=16, budget=64, grace_s=0.0, max_num_seqs=8):
        super().__init__(num_blocks, 4, max_num_seqs, budget, grace_s, prefix_cache=True)

    def add(self, request_id, prompt, max_tokens=1, n=1, namespace=NS, priority=0, grace_s=None):
        request_kw, adapter_key = {"prefix_cache_grace_s": grace_s}, None
        if namespace is None:
            request_kw["use_prefix_cache"] = False
        else:
            request_kw.update(cache_salt=namespace.cache_salt)
            adapter_key = namespace.adapter_id
        return super().add(request_id, list(prompt), max_tokens, n, priority, request_kw, adapter_key=adapter_key,
                           ignore_eos=True)

    def step(self, token=7):
        plan = self.sched.schedule()
        for s in plan.scheduled:         # a write never lands in a block the cache holds
            assert not any(self.pool.is_cached(s.block_table[p // 4])
                           for p in range(s.start_position, s.context_len))
        self.record(self.sched.update(plan, self.result(plan, token)))
        self.check()
        return plan

    def run(self, max_steps=200):
        plans = []
        for _ in range(max_steps):
            if not self.sched.has_unfinished():
                return plans
            plans.append(self.step())
        raise AssertionError("did not finish")


def span(first, last):
    return list(range(first, last + 1))


def test_hits_are_whole_blocks_and_never_the_last_token():
    h = Harness()
    h.add("a", span(1, 10), max_tokens=2)
    h.run()
    assert h.cache.cached_block_ids() == {0, 1}           # 11 computed tokens: 2 full blocks
    assert h.pool.num_used_blocks == 0 and h.pool.num_cached_only_blocks == 2
    b = h.add("b", span(1, 10))
    [item] = h.step().scheduled
    assert (item.start_position, item.token_ids, item.block_table) == (8, [9, 10], [0, 1, 3])
    h.run()
    c = h.add("c", span(1, 8))                            # block-aligned: the hit stops a block short
    [item] = h.step().scheduled
    assert (item.start_position, item.block_table) == (4, [0, 4])
    h.run()
    d = h.add("d", span(1, 9))                            # one past a block: one token computed
    [item] = h.step().scheduled
    assert (item.start_position, item.token_ids, item.block_table) == (8, [9], [0, 1, 5])
    h.run()
    assert (h.cached_tokens("a"), h.cached_tokens("b"), h.cached_tokens("c"), h.cached_tokens("d")) == (
        {0}, {8}, {4}, {8})
    assert (b.num_cached_tokens, c.num_cached_tokens, d.num_cached_tokens) == (8, 4, 8)
    assert h.cache.cached_block_ids() == {0, 1}           # c's copy of block 1 stayed its own
    stats = h.cache.stats()
    assert (stats.num_queries, stats.num_query_tokens, stats.num_hit_tokens) == (4, 37, 20)


def test_concurrent_requests_share_blocks_as_they_are_computed():
    h = Harness(budget=8)                                  # chunked prefill: 8 tokens a step
    h.add("a", span(1, 20), max_tokens=1)
    h.step()                                               # a computes 1..8: blocks 0, 1 cached
    h.add("b", span(1, 20), max_tokens=1)
    plan = h.step()                                        # a: 9..16 (the budget is spent)
    assert [(s.start_position, s.num_tokens) for s in plan.scheduled] == [(8, 8)]
    plan = h.step()                                        # a: 17..20; b hits a's 4 blocks
    assert [(s.start_position, s.num_tokens) for s in plan.scheduled] == [(16, 4), (16, 4)]
    assert [s.block_table for s in plan.scheduled] == [[0, 1, 2, 3, 4], [0, 1, 2, 3, 5]]
    h.run()
    assert h.cached_tokens("b") == {16}


def test_eviction_comes_before_preemption():
    h = Harness(num_blocks=8)
    h.add("a", span(1, 12), max_tokens=2)
    h.run()                                                # cached: 0 1 2; free: 3..7
    h.add("b", span(101, 120), max_tokens=2)               # 5 blocks, then a 6th to decode
    plans = h.run()
    assert h.sched.num_preemptions == 0
    assert h.cache.stats().num_evicted_blocks == 1
    assert plans[1].scheduled[0].block_table == [4, 5, 6, 7, 3, 2]   # a's LRU tail block went first
    assert h.cache.cached_block_ids() == {0, 1, 3, 4, 5, 6, 7}


def test_preempted_sequence_recomputes_from_its_cached_blocks():
    h = Harness(num_blocks=5)
    old = h.add("old", span(1, 4), max_tokens=12)
    new = h.add("new", span(101, 109), max_tokens=8)
    plans = h.run()
    assert new.num_preemptions >= 1 and old.num_preemptions == 0
    readmitted = [s for p in plans for s in p.scheduled if s.seq_id == new.seq_id]
    restart = next(i for i in range(1, len(readmitted))
                   if readmitted[i].start_position < readmitted[i - 1].context_len)
    # new computed blocks 1 2 3 before preemption; old's growth then evicted 3 and 2 (LRU,
    # tail first): new resumes after its surviving block 1 instead of from scratch.
    assert (readmitted[restart].start_position, readmitted[restart].block_table) == (4, [1, 2, 3, 4])
    assert new.output_token_ids == [7] * 8 and old.output_token_ids == [7] * 12
    assert h.cached_tokens("new") == {0}                    # reported for the first admission only


@pytest.mark.parametrize("prompt_len", [9, 10])
def test_fork_siblings_share_cached_blocks_and_copy_the_partial_one(prompt_len):
    h = Harness()
    h.add("a", span(1, 12))
    h.run()                                                # cached: 0 1 2
    leader = h.add("b", span(1, prompt_len), max_tokens=2, n=3)
    children = list(leader.pending_fork)
    plans = h.run()
    if prompt_len == 9:      # the leader's 8 tokens are all cached: it forks without computing
        assert plans[0].scheduled == [] and plans[1].block_copies == []
    else:                    # the leader computes token 9 into block 3; siblings copy it
        assert [(s.start_position, s.token_ids) for s in plans[0].scheduled] == [(8, [9])]
        assert plans[1].block_copies == [(3, 4), (3, 5)]
    assert [s.seq_id for s in plans[1].scheduled] == [leader.seq_id] + [c.seq_id for c in children]
    assert [s.block_table for s in plans[1].scheduled] == [[0, 1, 3], [0, 1, 4], [0, 1, 5]]
    assert sorted(u.sibling_index for u in h.updates if u.request_id == "b" and u.finish_reason) == [0, 1, 2]
    assert h.cached_tokens("b") == {8}
    assert h.pool.num_used_blocks == 0


@pytest.mark.parametrize("grace_s, turn_grace_s, advance_s, turn2_hit", [
    (100.0, None, 0.0, 12), (0.0, None, 0.0, 8), (100.0, None, 100.0, 8),
    (0.0, 100.0, 0.0, 12), (100.0, 0.0, 0.0, 8)])      # per-request grace overrides the default
def test_live_turn_survives_pressure_within_its_grace(grace_s, turn_grace_s, advance_s, turn2_hit):
    h = Harness(num_blocks=12, grace_s=grace_s)
    turn1 = h.add("turn1", span(1, 12), max_tokens=1, grace_s=turn_grace_s)
    h.run()
    assert h.cache.cached_block_ids() == {0, 1, 2}         # protected for grace_s
    h.clock.now += advance_s
    h.add("x", span(101, 112), max_tokens=8)               # x and y grow to 5 blocks each:
    h.add("y", span(201, 212), max_tokens=8)               # 10 > the 9 free blocks
    survived = True
    while h.sched.has_unfinished():
        h.step()
        survived &= {0, 1, 2} <= h.cache.cached_block_ids()
    assert survived == (turn2_hit == 12)
    assert h.sched.num_preemptions == (1 if survived else 0)   # y waits instead
    h.add("turn2", span(1, 12) + turn1.output_token_ids + [13, 14, 15])
    h.run()
    assert h.cached_tokens("turn2") == {turn2_hit}


def test_protected_blocks_yield_when_nothing_else_can_run():
    h = Harness(num_blocks=6, grace_s=100.0)
    h.add("turn1", span(1, 16))
    h.run()                                                # 4 blocks protected, 2 free
    h.add("big", span(101, 116))                           # needs 4: nothing runs, so it may evict
    h.run()
    assert h.cached_tokens("big") == {0} and h.cache.stats().num_evicted_blocks == 2


def test_opt_out_namespaces_and_abort():
    h = Harness()
    h.add("private", span(1, 12), namespace=None)
    h.run()
    assert h.cache.num_cached_blocks == 0
    h.add("t1", span(1, 12), namespace=CacheNamespace(cache_salt="t1"))
    h.run()
    h.add("t2", span(1, 12), namespace=CacheNamespace(cache_salt="t2"))
    h.add("lora", span(1, 12), namespace=CacheNamespace(adapter_id="x", cache_salt="t1"))
    h.add("t1-again", span(1, 12), namespace=CacheNamespace(cache_salt="t1"))
    h.run()
    assert [h.cached_tokens(r) for r in ("t1", "t2", "lora", "t1-again")] == [{0}, {0}, {0}, {8}]
    h.add("aborted", span(1, 12), max_tokens=5, namespace=CacheNamespace(cache_salt="t1"))
    h.step()
    assert h.sched.abort_request("aborted")[0].num_cached_tokens == 8
    h.sched.check_integrity()
    assert h.pool.num_used_blocks == 0
    assert h.pool.num_cached_only_blocks == 9                # t1, t2, lora: 3 blocks each
    assert h.kv.reset_prefix_cache() == 9 and h.kv.reset_prefix_cache() == 0
    assert h.pool.num_free_blocks == 16


@pytest.mark.parametrize("seed", range(6))
def test_random_traffic_keeps_every_invariant(seed):
    """Shared prefixes, n > 1, aborts, a tight pool and a ticking clock: integrity holds
    after every step (Harness.step), writes never land in cached blocks, all finish."""
    import random
    rng = random.Random(seed)
    h = Harness(num_blocks=24, budget=rng.choice([8, 16, 64]), grace_s=rng.choice([0.0, 5.0]), max_num_seqs=6)
    stems = [[rng.randrange(1, 50) for _ in range(rng.randrange(1, 30))] for _ in range(4)]
    live = []
    for step in range(300):
        if step < 200 and rng.random() < 0.3:
            prompt = rng.choice(stems)[:rng.randrange(1, 31)] + [rng.randrange(50, 60)] * rng.randrange(0, 6)
            namespace = rng.choice([NS, NS, CacheNamespace(cache_salt="other"), None])
            live.append(h.add(f"r{step}", prompt, max_tokens=rng.randrange(1, 12), n=rng.choice([1, 1, 2, 3]),
                              namespace=namespace).request_id)
        if live and rng.random() < 0.05:
            h.sched.abort_request(live.pop(rng.randrange(len(live))))
            h.sched.check_integrity()
        h.clock.now += 1.0
        if h.sched.has_unfinished():
            h.step(token=rng.randrange(1, 60))
    h.run()
    assert h.pool.num_used_blocks == 0
    h.kv.reset_prefix_cache()
    assert h.pool.num_free_blocks == h.pool.num_blocks


def test_aborted_requests_get_no_grace():
    h = Harness(grace_s=100.0)
    h.add("done", span(1, 8))
    h.add("gone", span(101, 112), max_tokens=5)
    h.step()
    h.sched.abort_request("gone")
    h.sched.check_integrity()
    assert sorted(h.cache.evict(16)) == [2, 3, 4]          # "gone"'s blocks; "done"'s are protected
    assert h.cache.cached_block_ids() == {0, 1}
