"""Tier 2: the prefix cache on the real model (CPU, fp32).

Greedy outputs are the same with the cache off, cold and warm and under preemption;
tenants, adapters and weight epochs never share blocks; a live conversation turn
survives memory pressure within its grace time and its next turn hits.
"""
from __future__ import annotations

import inspect
import textwrap

import pytest

from kvserve import LLM
from kvserve.engine.kv.cache_events import CacheNamespace
from kvserve.errors import AdapterNotFoundError
from kvserve.sampling.params import SamplingParams
from tests.support.parity import compare_greedy, top2_gaps_from_logprobs

pytestmark = pytest.mark.model
GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=2)
BLOCK = 16
BYTES_PER_TOKEN = 46080          # SmolLM2-135M in fp32 (see docs/architecture.md)
# Prefix lengths around block boundaries: one short, exactly aligned, one past.
PREFIX_LENGTHS = [15, 16, 17, 31, 32, 33, 47, 48, 49, 64, 65, 80]


@pytest.fixture(scope="module")
def source_ids(tokenizer) -> list[int]:
    return tokenizer.encode(inspect.getsource(textwrap) + inspect.getsource(inspect), add_special_tokens=False)


@pytest.fixture(scope="module")
def shared_prompts(source_ids) -> list[list[int]]:
    """36 prompts over two stems: every prefix length with no tail (so prompts are exact
    prefixes of others), a 3-token tail and a 7-token tail."""
    stems = [source_ids[:100], source_ids[1000:1100]]
    tails = source_ids[2000:]
    prompts = []
    for i in range(36):
        tail_len = (0, 3, 7)[i // 12]
        prompts.append(stems[(i // 6) % 2][:PREFIX_LENGTHS[i % 12]] + tails[i * 11:i * 11 + tail_len])
    return prompts


@pytest.fixture(scope="module")
def cache_off(llm, shared_prompts):
    """The reference: every request opted out of the cache."""
    outputs = llm.generate([{"prompt_token_ids": p} for p in shared_prompts], GREEDY, use_prefix_cache=False)
    assert all(o.num_cached_tokens == 0 for o in outputs)
    return outputs


def _compare(reference, candidate):
    gaps = [top2_gaps_from_logprobs(r.outputs[0].logprobs) for r in reference]
    compare_greedy([r.outputs[0].token_ids for r in reference], [c.outputs[0].token_ids for c in candidate], gaps)


def _check_idle(engine):
    engine.check_integrity()
    assert engine.block_pool.num_used_blocks == 0


def test_off_cold_warm_identical(llm, shared_prompts, cache_off):
    inputs = [{"prompt_token_ids": p} for p in shared_prompts]
    llm.reset_prefix_cache()
    cold = llm.generate(inputs, GREEDY)
    _check_idle(llm.engine)
    warm = llm.generate(inputs, GREEDY)
    _check_idle(llm.engine)
    # Warm: every full block of every prompt is cached, but the last token is computed.
    assert [o.num_cached_tokens for o in warm] == [(len(p) - 1) // BLOCK * BLOCK for p in shared_prompts]
    _compare(cache_off, cold)
    _compare(cache_off, warm)


def test_preemption_with_cache_identical(model_path, shared_prompts, cache_off):
    # 12 blocks x 16 tokens of KV for ~2,000 tokens of demand (the longest needs 6 blocks).
    small = LLM(model_path, dtype="float32", kv_cache_bytes=12 * BLOCK * BYTES_PER_TOKEN, max_num_seqs=16,
                max_num_batched_tokens=128)
    outputs = small.generate([{"prompt_token_ids": p} for p in shared_prompts], GREEDY)
    stats = small.engine.stats()
    print(f"preemptions {stats.num_preemptions}, evicted blocks {stats.prefix_cache_evicted_blocks}, "
          f"hit rate {stats.prefix_cache_hit_rate:.2f}")
    assert stats.num_preemptions >= 3 and stats.prefix_cache_evicted_blocks > 0
    assert stats.prefix_cache_hit_tokens > 0
    _compare(cache_off, outputs)
    _check_idle(small.engine)


def test_tenants_and_epochs_never_share(llm, source_ids):
    """Across tenants and weight epochs (across adapters: tests/model/test_lora_batching.py)."""
    prompt = {"prompt_token_ids": source_ids[3000:3070]}
    expected_hit = (70 - 1) // BLOCK * BLOCK
    params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)

    def cached(**kw):
        return llm.generate(prompt, params, **kw)[0].num_cached_tokens

    assert cached(cache_salt="tenant-a") == 0
    assert cached(cache_salt="tenant-b") == 0
    assert cached(cache_salt="tenant-a") == expected_hit
    with pytest.raises(AdapterNotFoundError):          # no LoRA on this engine: no adapter to name
        cached(adapter_id="x", cache_salt="tenant-a")
    cache, epoch = llm.engine.prefix_cache, llm.engine.weight_epoch
    namespaces = [CacheNamespace(None, epoch, salt) for salt in ("tenant-a", "tenant-b")]
    blocks = [cache.cached_block_ids(ns) for ns in namespaces]
    assert all(len(b) == 70 // BLOCK for b in blocks)
    assert len(set().union(*blocks)) == sum(len(b) for b in blocks)        # pairwise disjoint
    llm.engine.bump_weight_epoch()
    assert all(not cache.cached_block_ids(ns) for ns in namespaces)         # older epoch dropped
    assert cached(cache_salt="tenant-a") == 0
    assert cached(cache_salt="tenant-a") == expected_hit
    _check_idle(llm.engine)


def test_live_turn_survives_pressure_and_hits(model_path, source_ids):
    # 40 blocks; the conversation holds ~15, other traffic wants ~45 more.
    small = LLM(model_path, dtype="float32", kv_cache_bytes=40 * BLOCK * BYTES_PER_TOKEN, max_num_seqs=8,
                max_num_batched_tokens=256)
    tok = small.tokenizer
    system = tok.decode(source_ids[4000:4200])
    turn1 = [{"role": "system", "content": system}, {"role": "user", "content": "Summarise this code."}]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=2)
    first = small.chat(turn1, params, prefix_cache_grace_s=600.0)[0]
    live_blocks = small.engine.prefix_cache.cached_block_ids()
    traffic = [{"prompt_token_ids": source_ids[6000 + 300 * i:6000 + 300 * i + 90]} for i in range(7)]
    small.generate(traffic, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    stats = small.engine.stats()
    assert stats.prefix_cache_evicted_blocks > 0, "the traffic was meant to need eviction"
    assert live_blocks <= small.engine.prefix_cache.cached_block_ids()
    turn2 = turn1 + [{"role": "assistant", "content": first.outputs[0].text},
                     {"role": "user", "content": "Now in one sentence."}]
    second = small.chat(turn2, params, prefix_cache_grace_s=600.0)[0]
    computed = first.prompt_token_ids + first.outputs[0].token_ids[:-1]
    common = next((i for i, (a, b) in enumerate(zip(computed, second.prompt_token_ids)) if a != b),
                  min(len(computed), len(second.prompt_token_ids)))
    assert second.num_cached_tokens == min(common, len(second.prompt_token_ids) - 1) // BLOCK * BLOCK
    assert second.num_cached_tokens >= len(first.prompt_token_ids) // BLOCK * BLOCK
    reference = small.chat(turn2, params, use_prefix_cache=False)[0]
    _compare([reference], [second])
    _check_idle(small.engine)


def test_switched_off(model_path, shared_prompts, cache_off):
    off = LLM(model_path, dtype="float32", kv_cache_bytes=32 * 2**20, enable_prefix_cache=False)
    inputs = [{"prompt_token_ids": p} for p in shared_prompts[:4]]
    outputs = off.generate(inputs, GREEDY) + off.generate(inputs, GREEDY)
    assert all(o.num_cached_tokens == 0 for o in outputs)
    stats = off.engine.stats()
    assert not stats.prefix_cache_enabled and stats.prefix_cache_queries == 0
    assert off.reset_prefix_cache() == 0 and off.engine.drain_cache_events() == []
    _compare(cache_off[:4] * 2, outputs)
    _check_idle(off.engine)
