"""Tier 2: greedy outputs equal Hugging Face transformers on the same GGUF, in fp32.

Also batch invariance: every prompt alone or in a small batch gives what it gives inside the
batch of 32.
"""
from __future__ import annotations

import pytest
import torch

from kvserve.sampling.params import SamplingParams
from tests.support.parity import compare_greedy, teacher_forced, top2_gaps_from_logprobs

NEW_TOKENS = 32
pytestmark = pytest.mark.model


def greedy(max_tokens=NEW_TOKENS, logprobs=2):
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, logprobs=logprobs)


@pytest.fixture(scope="module")
def hf_reference(hf_model_folder, prompts, batched):
    """Per prompt, HF's greedy choice and log-softmax at each of our generated positions, our
    tokens so far as context (``teacher_forced``: equal choices everywhere mean HF's own greedy
    generation is ours), on the GGUF as transformers loads it (``hf_model_folder``)."""
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(hf_model_folder, dtype=torch.float32).eval()
    results = teacher_forced(model, prompts, [out.outputs[0].token_ids for out in batched])
    del model
    return results


@pytest.fixture(scope="module")
def batched(llm, prompts):
    """All 32 prompts in one generate call (continuous batching, mixed lengths)."""
    return llm.generate([{"prompt_token_ids": p} for p in prompts], greedy())


def test_prompt_set_is_varied(prompts):
    lengths = sorted(len(p) for p in prompts)
    assert len(prompts) >= 32 and lengths[0] < 16 and lengths[-1] >= 950


def test_greedy_ids_and_logprobs_match_hf(batched, hf_reference):
    reference = [ids for ids, _ in hf_reference]
    ours = [out.outputs[0].token_ids for out in batched]
    gaps = []
    for ids, logprobs in hf_reference:
        top2 = logprobs.topk(2, dim=-1).values
        gaps.append((top2[:, 0] - top2[:, 1]).tolist())
    tolerated = compare_greedy(reference, ours, gaps)
    assert len(tolerated) <= 3, "too many near-ties to be a real comparison"
    worst = 0.0
    for i, (out, (ref_ids, ref_logprobs)) in enumerate(zip(batched, hf_reference)):
        mine = out.outputs[0]
        agree = next((p for p, (a, b) in enumerate(zip(ref_ids, mine.token_ids)) if a != b), len(ref_ids))
        for pos in range(agree):
            token = mine.token_ids[pos]
            diff = abs(mine.logprobs[pos][token] - ref_logprobs[pos, token].item())
            worst = max(worst, diff)
    print(f"max |logprob - hf logprob| = {worst:.2e}")
    assert worst < 1e-3


BATCH_SIZES = (1, 1, 1, 1, 1, 1, 2, 3, 4, 5, 6, 6)      # the 32 prompts


def test_batch_invariance(llm, prompts, batched):
    """Every prompt gives alone or in a small batch what it gives in the batch of 32: six prompts
    alone (the three shortest and the three longest), the rest in batches of 2 to 6."""
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
    order = order[:3] + order[-3:] + order[3:-3]
    outputs: dict[int, object] = {}
    start = 0
    for size in BATCH_SIZES:
        chunk = order[start:start + size]
        start += size
        for i, out in zip(chunk, llm.generate([{"prompt_token_ids": prompts[i]} for i in chunk], greedy())):
            outputs[i] = out.outputs[0]
    assert start == len(prompts) and sorted(outputs) == list(range(len(prompts)))
    smaller = [outputs[i] for i in range(len(prompts))]
    gaps = [top2_gaps_from_logprobs(o.logprobs) for o in smaller]
    compare_greedy([o.token_ids for o in smaller], [b.outputs[0].token_ids for b in batched], gaps)
    llm.engine.check_integrity()
    assert llm.engine.block_pool.num_used_blocks == 0
