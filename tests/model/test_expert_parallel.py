"""Tier 2: expert parallelism over gloo with 2 ranks equals one process, on the tiny random
Qwen2-MoE of ``test_moe.py`` (8 experts, top-2, a shared expert, a dense middle layer):
experts 0-3 on rank 0 and 4-7 on rank 1, reached by all-to-all; attention and the dense
layer tensor-parallel. Greedy ids equal, chosen-token logprobs within 1e-4; the blocks'
expert load counts every routed pair and their collectives' seconds are recorded."""
from __future__ import annotations

import pytest

from kvserve.sampling.params import SamplingParams
from tests.model.test_moe import NEW_TOKENS, _prompts, _save_tiny_moe
from tests.model.test_tensor_parallel import assert_same_greedy

pytestmark = pytest.mark.model


def _generate(folder, tp: int):
    from kvserve import LLM
    llm = LLM(str(folder), dtype="float32", kv_cache_bytes=8 * 2**20, tensor_parallel_size=tp, num_threads=1)
    try:
        greedy = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=2)
        outs = llm.generate([{"prompt_token_ids": p} for p in _prompts()], greedy)
        blocks = llm.engine.runner.model.expert_parallel_blocks() if tp > 1 else {}
        counters = llm.engine.stats().parallel
    finally:
        llm.engine.close()
    return outs, blocks, counters


def test_ep2_equals_ep1(tmp_path):
    _save_tiny_moe(tmp_path, norm_topk_prob=True)
    ref, _, one = _generate(tmp_path, 1)
    got, blocks, two = _generate(tmp_path, 2)
    assert len(ref) >= 16
    assert_same_greedy(ref, got)
    assert sorted(blocks) == [0, 2]                     # layer 1 is dense (mlp_only_layers)
    for block in blocks.values():
        assert block.local_experts == 4 and len(block.experts.experts) == 4
        assert block.first_expert == 0                  # rank 0's half
        assert block.expert_load.shape == (8,) and int(block.expert_load.sum()) > 0
        assert int(block.expert_load.sum()) % 2 == 0    # top-2: two rows per token
        assert block.comm_seconds and all(s > 0 for s in block.comm_seconds)
    # the engine's stats (mirrored on /metrics): both layouts route the same rows to each expert
    assert (one.tensor_parallel_size, two.tensor_parallel_size) == (1, 2)
    assert len(two.expert_tokens) == 8 and two.expert_tokens == one.expert_tokens and sum(two.expert_tokens) > 0
    assert two.expert_imbalance >= 1.0 and 0 < two.sparse_collective_p50_s <= two.sparse_collective_p99_s
    assert two.collective_seconds > 0 and one.collective_seconds == 0
