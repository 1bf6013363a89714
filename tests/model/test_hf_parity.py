"""Tier 2: greedy outputs equal Hugging Face transformers on the same GGUF, in fp32.

Also batch invariance: every prompt alone gives what it gives inside the batch of 32.
"""
from __future__ import annotations

import pytest
import torch

from kvserve.sampling.params import SamplingParams
from tests.support.parity import compare_greedy, top2_gaps_from_logprobs

NEW_TOKENS = 32
pytestmark = pytest.mark.model


def greedy(max_tokens=NEW_TOKENS, logprobs=2):
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, logprobs=logprobs)


@pytest.fixture(scope="module")
def hf_reference(hf_model_folder, prompts):
    """HF greedy ids, the log-softmax of each step's logits, per prompt (the GGUF as
    transformers loads it: ``hf_model_folder``)."""
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(hf_model_folder, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None
    results = []
    with torch.inference_mode():
        for ids in prompts:
            out = model.generate(torch.tensor([ids]), max_new_tokens=NEW_TOKENS, do_sample=False,
                                 output_logits=True, return_dict_in_generate=True, pad_token_id=2,
                                 attention_mask=torch.ones(1, len(ids), dtype=torch.long))
            logprobs = torch.log_softmax(torch.stack(out.logits, dim=0)[:, 0].float(), dim=-1)  # [N, V]
            results.append((out.sequences[0, len(ids):].tolist(), logprobs))
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


def test_batch_invariance(llm, prompts, batched):
    alone = [llm.generate([{"prompt_token_ids": p}], greedy())[0].outputs[0] for p in prompts]
    gaps = [top2_gaps_from_logprobs(o.logprobs) for o in alone]
    compare_greedy([o.token_ids for o in alone], [b.outputs[0].token_ids for b in batched], gaps)
    llm.engine.check_integrity()
    assert llm.engine.block_pool.num_used_blocks == 0
