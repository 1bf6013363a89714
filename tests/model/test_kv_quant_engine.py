"""Tier 2: the 8-bit KV cache on the real default model (fp32 compute, CPU).

- the KV capacity the engine plans at start-up (blocks, tokens, sequences at full
  context) is the planner's figure for every KV dtype, the 8-bit ones hold 46,080 / 12,240
  = 3.76x the fp32 tokens (64 vs 17 blocks), and filling the pool admits exactly that
  many sequences;
- with an int8 (and an fp8) cache, greedy outputs are exactly the same across batch
  size (1 vs 8 at once), chunked prefill, preemption, prefix cache on/off, and
  speculative decoding (n-gram, self:8) on/off: every path reads the cache as stored.

(How far 8-bit KV moves outputs from fp32 KV is another test's business.)
"""
from __future__ import annotations

import dataclasses

import pytest

from kvserve import LLM
from kvserve.engine.request import EngineRequest
from kvserve.planner.dtypes import kv_dtype
from kvserve.planner.hardware import CATALOG
from kvserve.planner.kv_memory import model_kv_bytes_per_token
from kvserve.planner.memory import replica_memory
from kvserve.planner.profile import model_from_engine
from kvserve.sampling.params import SamplingParams

pytestmark = pytest.mark.model

GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
BOTH_BLOCKS = 12_533_760      # lcm of one 16-token block in fp32 (737,280 B) and in 8-bit (195,840 B)
FILL_CONTEXT = 16             # max_model_len of the filling test: 1 block per sequence


@pytest.mark.parametrize("kv", ["auto", "int8", "fp8_e4m3", "fp8_e5m2"])
def test_capacity_is_the_planners_and_fills_exactly(model_path, kv):
    budget = BOTH_BLOCKS
    llm = LLM(model_path, dtype="float32", kv_cache_dtype=kv, kv_cache_bytes=budget, max_model_len=FILL_CONTEXT,
              max_num_seqs=256, max_num_batched_tokens=4096, enable_prefix_cache=False)
    engine, plan = llm.engine, llm.engine.kv_plan
    assert engine.kv_cache_dtype == ("float32" if kv == "auto" else kv) and str(engine.dtype) == "torch.float32"
    assert engine.stats().kv_cache_dtype == engine.kv_cache_dtype
    planner_kv = kv_dtype(engine.kv_cache_dtype)
    model = model_from_engine(engine.model_config)
    assert model_kv_bytes_per_token(model, planner_kv.bytes, planner_kv.scale_bytes).value == plan.bytes_per_token
    hw = dataclasses.replace(CATALOG["h100-sxm"], memory_bytes=float(budget), memory_utilization=1.0,
                             runtime_overhead_bytes=0.0)       # the whole budget is the KV pool
    mem = replica_memory(model, hw, 0.0, planner_kv.bytes, 1, FILL_CONTEXT, 16, 0, 0, 0.0, planner_kv.scale_bytes)
    assert (mem.kv_tokens, mem.max_concurrency) == (plan.max_tokens, plan.max_seqs_at_full_context)
    expected_blocks = 17 if kv == "auto" else 64              # 12,533,760 B / 737,280 B or / 195,840 B
    assert plan.num_blocks == expected_blocks == plan.max_seqs_at_full_context
    assert plan.bytes_per_token == (46_080 if kv == "auto" else 2 * 30 * 3 * (64 + 4))   # 8-bit: x 3.7647 tokens
    print(f"{kv}: {plan.explanation}")
    # Fill: more full-context requests (2 prompt tokens + 14 to generate = one block) than
    # fit; one step admits exactly the arithmetic's count, the rest wait.
    for i in range(plan.max_seqs_at_full_context + 8):
        params = SamplingParams(temperature=0, max_tokens=FILL_CONTEXT - 2, ignore_eos=True)
        llm.add_request(EngineRequest(f"fill-{kv}-{i}", [100 + i, 200 + i], params,
                                      frozenset(llm.tokenizer.eos_token_ids)))
    engine.step()
    assert engine.scheduler.num_running == plan.max_seqs_at_full_context
    assert engine.block_pool.num_used_blocks == plan.num_blocks
    assert engine.scheduler.num_waiting == 8
    for i in range(plan.max_seqs_at_full_context + 8):
        engine.abort_request(f"fill-{kv}-{i}")
    engine.check_integrity()
    assert engine.block_pool.num_used_blocks == 0


# ------------------------------------------------------------------ invariance
@pytest.fixture(scope="module")
def chosen(prompts):
    """8 prompts, 5 to 330 tokens (738 in all: long enough to chunk and to preempt)."""
    return [prompts[i] for i in (0, 1, 2, 9, 10, 13, 22, 25)]


def quant_llm(kv: str, **kwargs) -> LLM:
    kwargs.setdefault("kv_cache_bytes", 64 * 2**20)
    return LLM(dtype="float32", kv_cache_dtype=kv, max_num_seqs=16, **kwargs)


def greedy(llm: LLM, prompts) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY)]


@pytest.fixture(scope="module", params=["int8", "fp8_e4m3"])
def quant(request, chosen):
    """(KV dtype, its engine, the reference: all 8 prompts at once, prefix cache on and cold)."""
    llm = quant_llm(request.param)
    return request.param, llm, greedy(llm, chosen)


def test_batch_size_one(quant, chosen):
    kv, _, reference = quant
    alone = quant_llm(kv, enable_prefix_cache=False)
    assert [greedy(alone, [p])[0] for p in chosen] == reference


def test_prefix_cache_on_and_off(quant, chosen):
    kv, llm, reference = quant
    hits = llm.engine.stats().prefix_cache_hit_tokens
    assert greedy(llm, chosen) == reference                            # warm: prompts served from cached blocks
    assert llm.engine.stats().prefix_cache_hit_tokens - hits >= 300
    assert greedy(quant_llm(kv, enable_prefix_cache=False), chosen) == reference


def test_chunked_prefill(quant, chosen):
    kv, _, reference = quant
    chunked = quant_llm(kv, max_num_batched_tokens=32)
    assert greedy(chunked, chosen) == reference


def test_preemption(quant, chosen):
    kv, _, reference = quant
    small = quant_llm(kv, kv_cache_bytes=24 * 16 * 12_240, max_num_batched_tokens=256)    # 24 blocks
    assert small.engine.kv_plan.num_blocks == 24
    assert greedy(small, chosen) == reference
    assert small.engine.scheduler.num_preemptions >= 1, "the pool was meant to force preemption"
    small.engine.check_integrity()


@pytest.mark.parametrize("method", ["ngram", "self:8"])
def test_speculative_on_and_off(quant, chosen, method):
    kv, _, reference = quant
    spec = quant_llm(kv, speculative=method)
    spec.engine.speculator.controller.adaptive = False       # speculate at full k every step
    outputs = spec.generate([{"prompt_token_ids": p} for p in chosen], GREEDY)
    assert [o.outputs[0].token_ids for o in outputs] == reference
    assert sum(o.num_draft_tokens for o in outputs) > 0
    spec.engine.check_integrity()
