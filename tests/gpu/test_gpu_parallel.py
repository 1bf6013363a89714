"""Tier 3: tensor parallelism over NCCL (skipped without two CUDA devices): SmolLM2 at TP=3
needs three, so the GPU variant splits a tiny untied Llama two ways and compares with TP=1 on
one GPU, fp32 (greedy ids, logprobs within 1e-4), as tests/model/test_tensor_parallel.py does
on CPU."""
from __future__ import annotations

import pytest
import torch

from kvserve.sampling.params import SamplingParams
from tests.model.test_tensor_parallel import _prompts, _save_tiny, assert_same_greedy

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")]


def test_tp2_nccl_equals_tp1_gpu(tmp_path, model_path):
    from kvserve import LLM
    _save_tiny("llama", tmp_path, model_path)
    greedy = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=2)
    outs = {}
    for tp in (1, 2):
        llm = LLM(str(tmp_path), device="cuda", dtype="float32", kv_cache_bytes=2**28, tensor_parallel_size=tp)
        try:
            outs[tp] = llm.generate(_prompts(), greedy)
        finally:
            llm.engine.close()
    assert_same_greedy(outs[1], outs[2])
