"""Tier 2: prompt logprobs (``SamplingParams.prompt_logprobs``; the server's echo +
logprobs) equal Hugging Face's on the same GGUF, across chunked prefill, preemption,
n > 1, and never reported twice."""
from __future__ import annotations


import pytest
import torch

from kvserve import LLM
from kvserve.sampling.params import SamplingParams

pytestmark = pytest.mark.model


@pytest.fixture(scope="module")
def hf_prompt_logprobs(hf_model_folder, prompts):
    """log p(prompt[i] | prompt[:i]) from HF for the first 6 prompts of the set."""
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(hf_model_folder, dtype=torch.float32).eval()
    out = []
    with torch.inference_mode():
        for ids in prompts[:6]:
            lp = torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), dim=-1)
            out.append([lp[i - 1, ids[i]].item() for i in range(1, len(ids))])
    del model
    return out


def _check(outputs, prompts, reference, k):
    for out, ids, ref in zip(outputs, prompts, reference):
        pl = out.prompt_logprobs
        assert len(pl) == len(ids) and pl[0] is None
        mine = [pl[i][ids[i]] for i in range(1, len(ids))]
        assert max(abs(a - b) for a, b in zip(mine, ref)) < 1e-3
        for entry in pl[1:]:
            assert len(entry) <= k + 1          # the prompt token plus the top k


def test_prompt_logprobs_match_hf_chunked(llm, prompts, hf_prompt_logprobs):
    params = SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=3)
    chunked = LLM(dtype="float32", kv_cache_bytes=256 << 20, max_num_batched_tokens=48)
    outputs = chunked.generate([{"prompt_token_ids": p} for p in prompts[:6]], params)
    _check(outputs, prompts[:6], hf_prompt_logprobs, 3)
    # without asking, there are none
    plain = llm.generate([{"prompt_token_ids": prompts[0]}], SamplingParams(temperature=0, max_tokens=2))
    assert plain[0].prompt_logprobs is None


def test_prompt_logprobs_under_preemption_and_n(prompts, hf_prompt_logprobs):
    """A pool so small that sequences are preempted and recomputed: each prompt position
    is still reported exactly once; n = 2 reports them once per request."""
    small = LLM(dtype="float32", kv_cache_bytes=6 << 20, max_num_batched_tokens=64)
    params = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True, prompt_logprobs=0, n=2)
    outputs = small.generate([{"prompt_token_ids": p} for p in prompts[:6]], params)
    assert small.engine.scheduler.num_preemptions > 0
    _check(outputs, prompts[:6], hf_prompt_logprobs, 0)
    small.engine.check_integrity()
