"""Tier 1: the block accounting of moving a prompt's KV blocks between two engines'
prefix caches (KVCacheManager import/export), the block hashes both sides agree on, and
the threshold rule. No model, no torch.

Block size 4 throughout. A "prefill engine" computes a prompt by allocating its blocks
and inserting the full ones into its cache; a "decode engine" imports them.
"""
import pytest

from kvserve.disagg.rule import Route, choose_route
from kvserve.engine.kv.block_pool import BlockPool
from kvserve.engine.kv.cache_events import BlockStored, CacheNamespace, prompt_block_hashes
from kvserve.engine.kv.manager import KVCacheManager
from kvserve.engine.kv.prefix_cache import PrefixCache
from kvserve.engine.request import EngineRequest
from kvserve.sampling.params import SamplingParams

BS = 4
NS = CacheNamespace()


def manager(num_blocks=32) -> KVCacheManager:
    pool = BlockPool(num_blocks, BS)
    return KVCacheManager(pool, PrefixCache(pool))


def compute(kv: KVCacheManager, tokens: list[int], namespace=NS) -> None:
    """A finished sequence over ``tokens``: its full blocks (never the last token) stay cached-only."""
    hit = kv.lock_prompt_prefix(namespace, tokens)
    num_full = (len(tokens) - 1) // BS
    new = kv.block_pool.allocate(num_full - hit.num_blocks)
    handle = kv.prefix_cache.insert(hit, tokens[hit.num_blocks * BS:num_full * BS], new)
    kv.prefix_cache.lock(handle)
    kv.unlock_prefix(hit)
    kv.block_pool.free(new)
    kv.unlock_prefix(handle)


def check(kv: KVCacheManager) -> None:
    """Nothing runs: every lock released, free + cached-only == total."""
    kv.check_integrity(running=[])
    pool = kv.block_pool
    assert pool.num_used_blocks == 0
    assert pool.num_free_blocks + pool.num_cached_only_blocks == pool.num_blocks


PROMPT = list(range(100, 123))          # 23 tokens: 5 full blocks, the last token outside them


def test_import_puts_blocks_in_the_cache_as_a_prefix_hit():
    prefill, decode = manager(), manager()
    compute(prefill, PROMPT)
    handle = prefill.lock_prompt_prefix(NS, PROMPT)
    assert handle.num_blocks == 5
    prefill.unlock_prefix(handle)
    pending = decode.begin_import(NS, PROMPT, first_block=0, num_blocks=5)
    assert pending.num_present == 0 and len(pending.block_ids) == 5
    assert decode.block_pool.num_used_blocks == 5                     # held by the import while written
    decode.finish_import(pending)
    check(prefill)
    check(decode)
    assert decode.block_pool.num_cached_only_blocks == 5
    assert decode.num_cached_prompt_blocks(NS, PROMPT) == 5
    assert decode.num_cached_prompt_blocks(NS, PROMPT + [7]) == 5


def test_blocks_already_cached_are_not_taken_again():
    decode = manager()
    compute(decode, PROMPT[:9])                                      # 2 full blocks cached
    pending = decode.begin_import(NS, PROMPT, first_block=1, num_blocks=4)
    assert pending.num_present == 2 and len(pending.block_ids) == 3  # block 1 was there: skipped
    decode.finish_import(pending)
    check(decode)
    assert decode.block_pool.num_cached_only_blocks == 5


def test_a_gap_before_the_first_block_refuses_and_holds_nothing():
    decode = manager()
    assert decode.begin_import(NS, PROMPT, first_block=2, num_blocks=3) is None
    check(decode)
    assert decode.block_pool.num_free_blocks == decode.block_pool.num_blocks


def test_everything_present_refuses_and_holds_nothing():
    decode = manager()
    compute(decode, PROMPT)
    assert decode.begin_import(NS, PROMPT, first_block=0, num_blocks=5) is None
    check(decode)


def test_cancel_gives_back_every_block_and_lock():
    decode = manager()
    compute(decode, PROMPT[:5])                                      # 1 block cached, locked during the import
    pending = decode.begin_import(NS, PROMPT, first_block=1, num_blocks=4)
    with pytest.raises(AssertionError):
        check(decode)                                                # the import holds blocks and a lock
    decode.cancel_import(pending)
    check(decode)
    assert decode.block_pool.num_cached_only_blocks == 1


def test_import_evicts_lru_blocks_and_takes_only_what_fits():
    decode = manager(num_blocks=6)
    compute(decode, list(range(900, 917)))                           # 4 unrelated cached-only blocks
    pending = decode.begin_import(NS, PROMPT, first_block=0, num_blocks=5)
    assert len(pending.block_ids) == 5                               # evicted 3 of them
    decode.finish_import(pending)
    check(decode)
    running = manager(num_blocks=3)
    held = running.block_pool.allocate(2)                            # a running sequence's blocks
    pending = running.begin_import(NS, PROMPT, first_block=0, num_blocks=5)
    assert len(pending.block_ids) == 1                               # a prefix of the range
    running.finish_import(pending)
    running.block_pool.free(held)
    check(running)
    assert running.num_cached_prompt_blocks(NS, PROMPT) == 1


def test_namespaces_stay_apart():
    decode = manager()
    salted = CacheNamespace(cache_salt="tenant-b")
    decode.finish_import(decode.begin_import(salted, PROMPT, 0, 5))
    assert decode.num_cached_prompt_blocks(NS, PROMPT) == 0
    assert decode.num_cached_prompt_blocks(salted, PROMPT) == 5


def test_prompt_hashes_equal_the_cache_block_hashes():
    kv = manager()
    kv.drain_events()
    compute(kv, PROMPT, CacheNamespace(adapter_id="a", weight_epoch=2))
    stored = [h for e in kv.drain_events() if isinstance(e, BlockStored) for h in e.block_hashes]
    assert stored == prompt_block_hashes(CacheNamespace(adapter_id="a", weight_epoch=2), PROMPT, BS)
    assert stored != prompt_block_hashes(CacheNamespace(adapter_id="a", weight_epoch=3), PROMPT, BS)
    assert len(prompt_block_hashes(NS, PROMPT[:8], BS)) == 1        # the last token is never in a full block
    assert len(prompt_block_hashes(NS, PROMPT[:9], BS)) == 2


def request(num_tokens: int, **kwargs) -> EngineRequest:
    return EngineRequest("r", list(range(num_tokens)), SamplingParams(max_tokens=4), **kwargs)


def test_threshold_rule():
    assert choose_route(request(100), 0, 16, 256).route is Route.UNIFIED
    long = choose_route(request(300), 0, 16, 256)
    assert long.route is Route.DISAGGREGATED and (long.first_block, long.end_block) == (0, 18)
    # the decode side caches 10 blocks: 140 tokens uncached < 256 -> unified, no transfer
    assert choose_route(request(300), 10, 16, 256).route is Route.UNIFIED
    partial = choose_route(request(600), 10, 16, 256)
    assert (partial.route, partial.first_block, partial.end_block) == (Route.DISAGGREGATED, 10, 37)
    assert partial.num_blocks == 27
    assert choose_route(request(300, use_prefix_cache=False), 0, 16, 256).route is Route.UNIFIED
    logprobs = EngineRequest("r", list(range(300)), SamplingParams(max_tokens=4, prompt_logprobs=1))
    assert choose_route(logprobs, 0, 16, 256).route is Route.UNIFIED


def test_kv_messages_cross_the_codec_as_they_are():
    from kvserve.ipc import codec, kv_messages as km
    messages = [km.AttachTransfer({"kind": "shm", "path": "/dev/shm/x", "num_slots": 4, "layout": {"num_layers": 2}}),
                km.QueryCachedBlocks("q", [1, 2, 3], "adapter", "salt"), km.CachedBlocks("q", 7),
                km.ExportOnFinish("r", "t0", [4, 5], 2), km.KVExported("r", "t0", 2, aborted=True),
                km.ImportKV("r", "t0", [4, 5], 2, 2, list(range(50)), None, "salt", 30.0),
                km.KVImported("r", "t0", 2, 1, 1, 0), km.CheckIntegrity(),
                km.IntegrityReport(True, "", 10, 4, 6, 0, 0)]
    frames = codec.FrameBuffer()
    assert frames.feed(b"".join(codec.encode(m) for m in messages)) == messages
