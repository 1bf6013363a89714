"""Tier 2: greedy outputs do not change under preemption or chunked prefill;
seeded sampling is reproducible across batch compositions."""
from __future__ import annotations

import pytest

from kvserve import LLM
from kvserve.sampling.params import SamplingParams
from tests.support.parity import compare_greedy, top2_gaps_from_logprobs

pytestmark = pytest.mark.model
GREEDY = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True, logprobs=2)


@pytest.fixture(scope="module")
def subset(prompts):
    """12 prompts, short to long (up to ~300 tokens, so a tiny pool still fits each)."""
    return [p for p in prompts if len(p) <= 400][:12]


@pytest.fixture(scope="module")
def uncontended(llm, subset):
    return llm.generate([{"prompt_token_ids": p} for p in subset], GREEDY)


def _compare(reference, candidate):
    gaps = [top2_gaps_from_logprobs(r.outputs[0].logprobs) for r in reference]
    compare_greedy([r.outputs[0].token_ids for r in reference],
                   [c.outputs[0].token_ids for c in candidate], gaps)


def test_preemption_invariance(model_path, subset, uncontended):
    # 40 blocks x 16 tokens = 640 tokens of KV for ~2,500 tokens of demand.
    small = LLM(model_path, dtype="float32", kv_cache_bytes=40 * 16 * 46080, max_num_seqs=16,
                max_num_batched_tokens=256)
    outputs = small.generate([{"prompt_token_ids": p} for p in subset], GREEDY)
    assert small.engine.scheduler.num_preemptions >= 3, "the pool was meant to force preemption"
    print(f"preemptions: {small.engine.scheduler.num_preemptions}")
    _compare(uncontended, outputs)
    small.engine.check_integrity()
    assert small.engine.block_pool.num_used_blocks == 0


def test_chunked_prefill_invariance(model_path, prompts, llm):
    chosen = prompts[-6:] + prompts[:4]                       # long ones need many chunks
    reference = llm.generate([{"prompt_token_ids": p} for p in chosen], GREEDY)
    chunked = LLM(model_path, dtype="float32", kv_cache_bytes=256 * 2**20, max_num_batched_tokens=40)
    outputs = chunked.generate([{"prompt_token_ids": p} for p in chosen], GREEDY)
    assert max(len(p) for p in chosen) > 20 * 40
    _compare(reference, outputs)


def test_seeded_sampling_is_reproducible_across_batches(llm, prompts):
    seeded = SamplingParams(temperature=0.9, top_p=0.95, max_tokens=24, seed=1234, ignore_eos=True)
    alone = llm.generate([{"prompt_token_ids": prompts[0]}], seeded)[0].outputs[0].token_ids
    noise = [SamplingParams(temperature=1.0, max_tokens=n, ignore_eos=True) for n in (5, 40, 17)]
    mixed = llm.generate([{"prompt_token_ids": p} for p in (prompts[3], prompts[0], prompts[20], prompts[5])],
                         [noise[0], seeded, noise[1], noise[2]])
    assert mixed[1].outputs[0].token_ids == alone
    other_seed = llm.generate([{"prompt_token_ids": prompts[0]}], seeded.clone(seed=99))[0].outputs[0].token_ids
    assert other_seed != alone


def test_n_siblings_share_prompt_and_differ(llm, prompts):
    params = SamplingParams(n=4, temperature=1.0, max_tokens=16, seed=7, ignore_eos=True)
    out = llm.generate([{"prompt_token_ids": prompts[25]}], params)[0]
    assert len(out.outputs) == 4
    assert len({tuple(o.token_ids) for o in out.outputs}) > 1
    again = llm.generate([{"prompt_token_ids": prompts[25]}], params)[0]
    assert [o.token_ids for o in again.outputs] == [o.token_ids for o in out.outputs]
    greedy_n = llm.generate([{"prompt_token_ids": prompts[25]}], SamplingParams(n=3, temperature=0, max_tokens=16,
                                                                                 ignore_eos=True))[0]
    single = llm.generate([{"prompt_token_ids": prompts[25]}], SamplingParams(temperature=0, max_tokens=16,
                                                                              ignore_eos=True))[0]
    assert all(o.token_ids == single.outputs[0].token_ids for o in greedy_n.outputs)
    llm.engine.check_integrity()


def test_class_mix_invariance(model_path, subset, uncontended):
    """Classes change timing, never tokens: interactive / chat / batch requests through the
    SLO policy (a tight TPOT target shrinking the budget, a batching window, admission
    preempting batch work in a small pool) give the uncontended greedy outputs."""
    mixed = LLM(model_path, dtype="float32", kv_cache_bytes=24 * 16 * 46080, max_num_seqs=16,
                max_num_batched_tokens=96, scheduling_policy="slo", batch_window_s=0.02,
                class_targets={"interactive": {"tpot_s": 0.001}}, min_step_tokens=8)
    chosen = subset[:6]
    classes = ["batch", "batch", "chat", "interactive", "batch", "interactive"]
    outputs = mixed.generate([{"prompt_token_ids": p} for p in chosen], GREEDY, service_class=classes)
    print(f"preemptions: {mixed.engine.scheduler.num_preemptions}")
    _compare(uncontended[:6], outputs)
    mixed.engine.check_integrity()
    assert mixed.engine.block_pool.num_used_blocks == 0


def test_fair_share_invariance(model_path, subset, uncontended):
    """Tenants change timing, never tokens: two tenants (weights 1:3) through the fair-share
    policy over the SLO classes, four slots and a small pool (preemption), give the
    uncontended greedy outputs."""
    # 12 blocks x 16 tokens = 192 tokens of KV for four sequences of ~75 tokens each.
    shared = LLM(model_path, dtype="float32", kv_cache_bytes=12 * 16 * 46080, max_num_seqs=4,
                 max_num_batched_tokens=96, fair_share=True, tenant_weights={"light": 3.0})
    chosen = subset[:6]
    tenants = ["heavy", "heavy", "light", "heavy", None, "light"]
    outputs = shared.generate([{"prompt_token_ids": p} for p in chosen], GREEDY, tenant=tenants)
    print(f"preemptions: {shared.engine.scheduler.num_preemptions}")
    assert shared.engine.scheduler.num_preemptions >= 1, "the pool was meant to force preemption"
    _compare(uncontended[:6], outputs)
    served = shared.engine.stats().tenant_served_tokens
    assert set(served) == {"heavy", "light", ""} and served["light"] >= sum(len(chosen[i]) for i in (2, 5))
    shared.engine.check_integrity()
    assert shared.engine.block_pool.num_used_blocks == 0
