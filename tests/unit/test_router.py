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
    prompt = list(range(256))                            # 64 blocks
    policy.index.record("b", request_block_hashes(prompt, NS, BS))
    replicas = _replicas("a", "b")
    decision = policy.choose(replicas, _request(prompt + [99]))
    assert (decision.replica, decision.reason, decision.matched_blocks, decision.num_blocks) == ("b", "prefix", 64, 64)
    assert decision.cached_tokens == 256
    # costs in prompt tokens: a computes 257, b computes 1 + 32 per request it holds
    replicas[1].num_running = 7                          # 1 + 224 < 257
    assert policy.choose(replicas, _request(prompt + [99])).replica == "b"
    replicas[1].num_running, replicas[0].queued_tokens = 10, 100   # prompt tokens queued at a count as work
    assert policy.choose(replicas, _request(prompt + [99])).replica == "b"     # 1 + 320 < 257 + 100
    replicas[1].num_running, replicas[0].queued_tokens = 9, 0
    assert policy.choose(replicas, _request(prompt + [99])).replica == "a"     # 1 + 288 > 257


def test_cold_requests_spread_and_other_namespaces_never_match():
    policy = make_policy("kv_aware", block_size=BS)
    prompt = list(range(16))
    policy.index.record("a", request_block_hashes(prompt, NS, BS))
    replicas = _replicas("a", "b", "c")
    bob = CacheNamespace(cache_salt="tenant:bob")
    decisions = [policy.choose(replicas, _request([n] * 16, namespace=bob)) for n in range(3)]
    assert sorted(d.replica for d in decisions) == ["a", "b", "c"]
    assert all(d.matched_blocks == 0 and d.reason == "spread" for d in decisions)


def test_kv_aware_predicts_the_blocks_of_requests_just_sent_until_the_replica_reports():
    now = [0.0]
    policy = make_policy("kv_aware", block_size=BS)
    policy.clock = lambda: now[0]
    replicas = _replicas("a", "b")
    system = list(range(64))                             # a new system prompt, 16 blocks, sent twice at once
    first = policy.choose(replicas, _request(system + [1] * 4))
    second = policy.choose(replicas, _request(system + [2] * 4))
    assert (second.replica, second.reason, second.matched_blocks) == (first.replica, "prefix", 16)
    policy.index.forget(first.replica)                  # a report that does not hold them yet: still predicted
    assert policy.choose(replicas, _request(system + [3] * 4)).replica == first.replica
    now[0] = 60.0                                        # long expired, and never reported: cold again
    late = [policy.choose(replicas, _request(system + [n] * 4)) for n in (4, 5)]
    assert late[0].matched_blocks == 0 and late[0].reason == "spread"


def test_session_key_and_resident_adapter_pull_toward_a_replica():
    policy = make_policy("kv_aware", block_size=BS)
    replicas = _replicas("a", "b")
    first = policy.choose(replicas, _request([1, 2], session="conv-1"))
    again = policy.choose(replicas, _request([3, 4], session="conv-1"))
    assert again.replica == first.replica and again.reason == "session"
    lora = CacheNamespace(adapter_id="sql")
    replicas[1].resident_adapters = frozenset({"sql"})
    assert policy.choose(replicas, _request([5, 6], namespace=lora)).replica == "b"


def test_a_requests_model_resolves_to_the_adapters_identity():
    from kvserve.router.state import adapter_identity
    ids = {"sql": "d1g357", "chat:v2": "c4a7"}
    assert adapter_identity("sql", ids) == "d1g357"
    assert adapter_identity("SmolLM2-135M-Instruct:sql", ids) == "d1g357"       # <base>:<adapter>
    assert adapter_identity("chat:v2", ids) == "c4a7"                            # a name with ':'
    assert adapter_identity("SmolLM2-135M-Instruct", ids) is None                # the base model
    assert adapter_identity(None, ids) is None and adapter_identity("sql", {}) is None


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


def test_weights_are_configurable_and_parse_from_the_command_line():
    prompt = list(range(16))                             # b holds all 16 tokens and runs 1 request
    replicas = _replicas("a", "b")
    replicas[1].num_running = 1
    for weights, expected in (("request=8", "b"), ("request=32", "a"), (None, "a")):
        policy = make_policy("kv_aware", block_size=BS, weights=RouterWeights.parse(weights))
        policy.index.record("b", request_block_hashes(prompt, NS, BS))
        assert policy.choose(replicas, _request(prompt)).replica == expected, weights
    assert RouterWeights.parse("prefill=2, session=0") == RouterWeights(prefill=2.0, session=0.0)
    with pytest.raises(ValueError, match="unknown router weight 'load'"):
        RouterWeights.parse("load=1")


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


def test_a_prefix_every_replica_holds_does_not_pull_and_a_partial_one_pulls_by_its_tokens():
    policy = make_policy("kv_aware", block_size=BS)
    template = list(range(40))                           # 10 blocks: a shared system prompt, say
    for name in ("a", "b"):
        policy.index.record(name, request_block_hashes(template, NS, BS))
    replicas = _replicas("a", "b")
    decisions = [policy.choose(replicas, _request(template + [n] * 8)) for n in range(4)]
    assert sorted(d.replica for d in decisions) == ["a", "a", "b", "b"]
    assert all(d.reason == "spread" and d.matched_blocks == 10 for d in decisions)
    policy.index.record("a", request_block_hashes(template + [7] * 40, NS, BS))   # a also holds a 40-token turn
    replicas[0].num_running = 1                          # 32 for the request it runs < 40 tokens saved
    held = policy.choose(replicas, _request(template + [7] * 40 + [8] * 4))
    assert (held.replica, held.reason, held.matched_blocks) == ("a", "prefix", 20)
    replicas[0].num_running = 2                          # 64 > 40
    assert policy.choose(replicas, _request(template + [7] * 40 + [9] * 4)).replica == "b"


def test_cluster_serve_checks_router_weights_when_parsing():
    from kvserve.cli import build_parser
    parser = build_parser()
    args = parser.parse_args(["cluster", "serve", "--router-weights", "request=16,session=0"])
    assert RouterWeights.parse(args.router_weights) == RouterWeights(request=16.0, session=0.0)
    with pytest.raises(SystemExit):
        parser.parse_args(["cluster", "serve", "--router-weights", "load=1"])
