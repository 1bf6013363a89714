"""Tier 1: the router's pure scoring (kvserve/router/): each policy's choice on replica states
built by hand, ties and cold requests spread, and the KV-aware index equal to what an engine's
prefix cache actually holds (fed by its real cache events)."""
import pytest

from kvserve.engine.kv.block_pool import BlockPool
from kvserve.engine.kv.cache_events import CacheNamespace
from kvserve.engine.kv.prefix_cache import PrefixCache
from kvserve.router import BlockIndex, ReplicaState, RouteRequest, RouterWeights, make_policy, request_block_hashes
from kvserve.router.policies import NoReplicaError

BS = 4
NS = CacheNamespace(cache_salt="tenant:alice")


def _cache_run(cache: PrefixCache, tokens: list[int], namespace=NS) -> None:
    """A finished sequence over ``tokens`` (whole blocks): its blocks stay cached."""
    handle = cache.match(namespace, tokens)
    table = cache.block_pool.allocate(len(tokens) // BS - handle.num_blocks)
    cache.insert(handle, tokens[handle.num_tokens:], table)
    cache.block_pool.free(table)


def _replicas(*names, **kw):
    return [ReplicaState(n, max_num_seqs=4, **kw) for n in names]


def _request(tokens, session=None, namespace=NS):
    return RouteRequest(tuple(tokens), namespace, session)


def test_index_from_real_cache_events_counts_the_blocks_the_cache_holds():
    cache, index = PrefixCache(BlockPool(64, BS)), BlockIndex()
    system = list(range(100, 112))                       # 3 blocks shared by two conversations
    _cache_run(cache, system + [1, 2, 3, 4, 5, 6, 7, 8])
    _cache_run(cache, system + [9, 9, 9, 9])
    _cache_run(cache, [7] * 8, namespace=CacheNamespace(cache_salt="tenant:bob"))
    for event in cache.drain_events():
        index.apply("r0", event)
    queries = [system + [1, 2, 3, 4, 0, 0, 0, 0], system + [9, 9, 9, 9, 9], system[:7], [5] * 12, [7] * 8]
    for tokens in queries:
        hashes = request_block_hashes(tokens, NS, BS)
        assert index.prefix_length("r0", hashes) == cache.match(NS, tokens).num_blocks
    assert index.prefix_length("r0", request_block_hashes([7] * 8, CacheNamespace(cache_salt="tenant:bob"), BS)) == 2
    cache.evict(cache.num_cached_blocks)                  # everything unlocked goes
    for event in cache.drain_events():
        index.apply("r0", event)
    assert index.num_blocks("r0") == 0


def test_round_robin_takes_healthy_replicas_in_turn():
    policy = make_policy("round_robin")
    replicas = _replicas("a", "b", "c")
    replicas[1].healthy = False
    assert [policy.choose(replicas, _request([1])).replica for _ in range(4)] == ["a", "c", "a", "c"]


def test_least_loaded_prefers_free_slots_and_spreads_ties():
    policy = make_policy("least_loaded")
    replicas = _replicas("a", "b", "c")
    replicas[0].num_running = 3
    assert {policy.choose(replicas, _request([1])).replica for _ in range(2)} == {"b", "c"}
    replicas[1].kv_usage = 0.5
    assert policy.choose(replicas, _request([1])).replica == "c"


def test_kv_aware_goes_where_the_prefix_is_until_the_load_outweighs_it():
    policy = make_policy("kv_aware", block_size=BS)
    prompt = list(range(16))                             # 4 blocks
    policy.index.record("b", request_block_hashes(prompt, NS, BS))
    replicas = _replicas("a", "b")
    decision = policy.choose(replicas, _request(prompt + [99]))
    assert (decision.replica, decision.reason, decision.matched_blocks, decision.num_blocks) == ("b", "prefix", 4, 4)
    # whole prompt cached (score +1.0) against 0.5 per request held: b wins while it holds under 2 more
    replicas[1].num_running = 1                          # 1 - 0.5 > 0
    assert policy.choose(replicas, _request(prompt)).replica == "b"
    replicas[1].num_waiting = 2                          # 1 - 1.5 < 0
    assert policy.choose(replicas, _request(prompt)).replica == "a"


def test_cold_requests_spread_and_other_namespaces_never_match():
    policy = make_policy("kv_aware", block_size=BS)
    prompt = list(range(16))
    policy.index.record("a", request_block_hashes(prompt, NS, BS))
    replicas = _replicas("a", "b", "c")
    bob = CacheNamespace(cache_salt="tenant:bob")
    decisions = [policy.choose(replicas, _request(prompt, namespace=bob)) for _ in range(3)]
    assert sorted(d.replica for d in decisions) == ["a", "b", "c"]
    assert all(d.matched_blocks == 0 and d.reason == "spread" for d in decisions)


def test_session_key_and_resident_adapter_pull_toward_a_replica():
    policy = make_policy("kv_aware", block_size=BS)
    replicas = _replicas("a", "b")
    first = policy.choose(replicas, _request([1, 2], session="conv-1"))
    again = policy.choose(replicas, _request([3, 4], session="conv-1"))
    assert again.replica == first.replica and again.reason == "session"
    lora = CacheNamespace(adapter_id="sql")
    replicas[1].resident_adapters = frozenset({"sql"})
    assert policy.choose(replicas, _request([5, 6], namespace=lora)).replica == "b"


def test_prefix_approx_learns_from_its_own_choices():
    policy = make_policy("prefix_approx", block_size=BS, max_history_blocks=8)
    replicas = _replicas("a", "b", "c")
    system = list(range(8))
    first = policy.choose(replicas, _request(system + [1, 1, 1, 1]))
    later = [policy.choose(replicas, _request(system + [n] * 4)) for n in range(2, 5)]
    assert all(d.replica == first.replica and d.reason == "prefix" and d.matched_blocks == 2 for d in later)
    assert policy.index.num_blocks(first.replica) <= 8


def test_unhealthy_replicas_are_never_chosen_and_none_left_is_an_error():
    replicas = _replicas("a", "b")
    replicas[0].healthy = False
    for name in ("round_robin", "least_loaded", "prefix_approx", "kv_aware"):
        policy = make_policy(name, block_size=BS)
        assert {policy.choose(replicas, _request([1, 2, 3, 4])).replica for _ in range(3)} == {"b"}
    replicas[1].healthy = False
    with pytest.raises(NoReplicaError):
        make_policy("kv_aware").choose(replicas, _request([1]))
    with pytest.raises(ValueError, match="round_robin"):
        make_policy("random")


def test_weights_are_configurable():
    policy = make_policy("kv_aware", block_size=BS, weights=RouterWeights(prefix=1.0, load=2.0))
    prompt = list(range(16))
    policy.index.record("b", request_block_hashes(prompt, NS, BS))
    replicas = _replicas("a", "b")
    replicas[1].num_running = 1                          # 1 request x 2.0 = 2.0 > 1.0 of prefix
    assert policy.choose(replicas, _request(prompt)).replica == "a"


def test_the_engine_loop_ships_cache_block_hashes_that_rebuild_the_cached_set():
    import socket

    from kvserve.ipc import codec
    from kvserve.ipc.engine_proc import EngineLoop

    cache = PrefixCache(BlockPool(32, BS))

    class Engine:
        def drain_cache_events(self):
            return cache.drain_events()

    ours, theirs = socket.socketpair()
    with ours, theirs:
        loop = EngineLoop(Engine(), ours)
        _cache_run(cache, list(range(16)))
        loop.send_cache_blocks()
        cache.evict(2)                                   # the last two blocks leave
        _cache_run(cache, [5] * 8)
        loop.send_cache_blocks()
        loop.send_cache_blocks()                         # nothing new: nothing sent
        theirs.settimeout(5)
        frames, messages = codec.FrameBuffer(), []
        while len(messages) < 2:
            messages.extend(frames.feed(theirs.recv(1 << 16)))
    held: set[int] = set()
    for message in messages:
        assert isinstance(message, codec.CacheBlocks)
        held.difference_update(message.removed)
        held.update(message.stored)
    index = BlockIndex()
    index.record("r", held)
    assert index.prefix_length("r", request_block_hashes(list(range(16)), NS, BS)) == 2
    assert index.prefix_length("r", request_block_hashes([5] * 8, NS, BS)) == 2
    assert len(held) == cache.num_cached_blocks == 4


def test_a_prefix_of_half_the_prompt_or_less_does_not_pull():
    policy = make_policy("kv_aware", block_size=BS)
    template = list(range(4))                            # one shared block (a default system prompt, say)
    policy.index.record("a", request_block_hashes(template, NS, BS))
    replicas = _replicas("a", "b")
    decisions = [policy.choose(replicas, _request(template + [n] * 8)) for n in range(4)]   # 1 of 3 blocks
    assert sorted(d.replica for d in decisions) == ["a", "a", "b", "b"]
    assert all(d.reason == "spread" for d in decisions)
    half = policy.choose(replicas, _request(template + [9] * 4))                           # 1 of 2 blocks
    assert half.reason == "spread"
    policy.index.record("b", request_block_hashes(template + [9] * 4, NS, BS))
    most = policy.choose(replicas, _request(template + [9] * 8))                           # 2 of 3 blocks
    assert (most.replica, most.reason) == ("b", "prefix")
