"""Tier 1: the coalesced replica's prefix cache per group (``fleetsim/cached_replica.py``): LRU
eviction of what no running request reads (groups, finished requests' own blocks), the pool's
accounting, the events a router hears.
Its agreement with the engine's cache is in test_fleetsim_prefix.py."""
from __future__ import annotations

from dataclasses import replace

from kvserve.engine.kv.cache_events import BlockRemoved, BlockStored, CacheNamespace
from kvserve.fleetsim.cached_replica import BLOCK_SIZE, EntryCache, PrefixCachingReplica
from kvserve.fleetsim.log import RequestLog
from kvserve.fleetsim.prompt_ids import REPLY_ID, prompt_token_ids
from kvserve.fleetsim.run import prepare
from kvserve.fleetsim.scenario import ModelTraffic, Scenario
from kvserve.router.index import request_block_hashes
from tests.support.replica_driver import cached_pool_holds, drive

SCENARIO = Scenario(name="cache", models=(ModelTraffic("a", "llama-3-8b", 256.0, 64.0),), peak_users=10,
                    think_s=60, duration_s=60, budget_usd_month=1e6, policies=("always_on",))


def test_eviction_takes_unread_groups_least_recently_used_first():
    cache = EntryCache()
    for group in range(3):
        cache.insert(group, 100)                  # each read by the request that computed it
    cache.release(0)
    cache.release(2)
    cache.acquire(0)
    cache.release(0)                              # 0 used after 2: 2 is the least recently used
    assert (cache.held_tokens, cache.pinned_tokens) == (300, 100)
    assert cache.evictable_tokens([2]) == 100 and cache.evictable_tokens([1]) == 200 == cache.evictable_tokens()
    assert cache.evict(50) == [2]
    assert cache.evict(1000) == [0]               # group 1 is read: never evicted
    assert 1 in cache and cache.held_tokens == cache.pinned_tokens == 100


def _run(replica: PrefixCachingReplica, log: RequestLog) -> None:
    """Run ``log`` through the replica, checking the pool's accounting at every event."""
    drive(replica, log, cached_pool_holds)


def test_a_small_pool_evicts_groups_and_the_router_hears_what_it_holds():
    """Four groups of 1,024-token prefixes through a pool that holds about two with the running
    requests: groups come and go, the events name exactly the blocks a real engine would hash,
    and at the end every reservation is returned."""
    sizing = replace(prepare(SCENARIO).sizings[0], kv_tokens=4096, max_num_seqs=2)
    groups = [0, 1, 2, 3, 0, 1, 2, 3, 0, 0]
    log = RequestLog([float(i) for i in range(10)], [0] * 10, [0] * 10, [1024 + 40] * 10, [8] * 10,
                     groups, [1024] * 10)
    replica = PrefixCachingReplica("r", sizing, log)
    heard: dict[int, int] = {}                    # block hash -> times stored minus times removed
    events = []

    def listen(name, batch):
        assert name == "r"
        for event in batch:
            events.append(event)
            for h in event.block_hashes:
                heard[h] = heard.get(h, 0) + (1 if isinstance(event, BlockStored) else -1)

    replica.cache_listener = listen
    _run(replica, log)
    assert all(log.first_token_s[r] <= log.finish_s[r] for r in range(10))
    assert any(isinstance(e, BlockRemoved) for e in events)                 # the pool was too small for all
    assert log.cached_tokens[-1] == 1024 and log.cached_tokens[:4] == [0, 0, 0, 0]
    held = {h for h, n in heard.items() if n == 1}
    assert set(heard.values()) <= {0, 1}
    expected = set()
    for key, (tokens, _) in replica.cache.entries.items():
        if key >= 0:                              # a group's prefix
            ids = prompt_token_ids(log, groups.index(key))[:tokens]
            expected |= set(request_block_hashes(ids, CacheNamespace(), BLOCK_SIZE))
        else:                                     # a finished request's blocks after its group's prefix
            request = -2 - key
            ids = prompt_token_ids(log, request) + [REPLY_ID] * (log.output[request] - 1)
            expected |= set(request_block_hashes(ids[:1024 + tokens], CacheNamespace(), BLOCK_SIZE)[1024 // BLOCK_SIZE:])
    assert held == expected
    assert replica.reserved == 0 and replica.cache.pinned_tokens == 0 and replica.queued_tokens == 0
    own = {key: tokens for key, (tokens, _) in replica.cache.entries.items() if key < 0}
    assert own and all(tokens == (1024 + 40 + 8 - 1) // BLOCK_SIZE * BLOCK_SIZE - 1024 for tokens in own.values())


def test_conversations_grow_their_history_and_the_pool_stays_within_its_size():
    """Three conversations of three turns, interleaved, through a pool too small for their
    histories and a running turn: each turn's history replaces its conversation's entry, a next turn on a history
    still there reads all of it, evicted ones are computed again, and the accounting holds."""
    sizing = replace(prepare(SCENARIO).sizings[0], kv_tokens=1500, max_num_seqs=2)
    parent = [-1, -1, -1, 0, 1, 2, 3, 4, 5]
    prompt, output = [400] * 3, [100] * 9
    for r in range(3, 9):
        prompt.append(prompt[parent[r]] + output[parent[r]] + 50)
    log = RequestLog([10.0 * r for r in range(9)], [0] * 9, [0] * 9, prompt, output, parent=parent)
    replica = PrefixCachingReplica("r", sizing, log)
    _run(replica, log)
    assert replica.reserved == 0 and replica.cache.pinned_tokens == 0
    histories = {key: tokens for key, (tokens, _) in replica.cache.entries.items()}
    assert set(histories) <= {-2, -3, -4}                  # one entry per conversation, keyed by its first turn
    assert all(tokens % BLOCK_SIZE == 0 for tokens in histories.values())
    full = [(prompt[r] + output[r] - 1) // BLOCK_SIZE * BLOCK_SIZE for r in range(9)]
    assert any(log.cached_tokens[r] == full[parent[r]] for r in range(3, 9))    # a whole history read
    assert any(log.cached_tokens[r] == 0 for r in range(3, 9))                  # one evicted first
