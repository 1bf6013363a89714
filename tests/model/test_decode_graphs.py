"""The decode-graph path's padded, bucketed forward gives the eager engine's greedy tokens.

On a CPU no graph is captured (``capture=False``): the same padded buffers run eagerly, so
this checks what the path adds to a forward (bucketing, padding rows that repeat the first
sequence, padded block tables, buffers reused across steps). tests/gpu replays real graphs.
"""
from __future__ import annotations

import torch

from kvserve.attention import get_backend
from kvserve.engine.cuda_graphs import DecodeGraphs
from kvserve.sampling.params import SamplingParams
from tests.support.parity import compare_greedy, top2_gaps_from_logprobs


def test_padded_decode_path_matches_eager(model_path, llm, prompts):
    from kvserve import LLM
    padded = LLM(model_path, dtype="float32", kv_cache_bytes=256 * 2**20, max_num_seqs=16,
                 max_num_batched_tokens=1024)
    runner, mc = padded.engine.runner, padded.engine.model_config
    graphs = DecodeGraphs(runner.model, runner.kv_cache,
                          lambda: get_backend("torch", mc.num_heads, mc.num_kv_heads, mc.head_dim),
                          runner.block_size, 16, 2048 // runner.block_size, torch.device("cpu"), capture=False)
    runner.decode_graphs = graphs
    # different lengths: the batch shrinks through buckets 16 -> 8 -> 4 -> 2 -> 1 as requests end
    requests = [({"prompt_token_ids": p}, SamplingParams(temperature=0, max_tokens=6 + 3 * i, ignore_eos=True,
                                                          logprobs=2)) for i, p in enumerate(prompts[:12])]
    ours = padded.generate([r for r, _ in requests], [s for _, s in requests])
    ref = llm.generate([r for r, _ in requests], [s for _, s in requests])
    compare_greedy([r.outputs[0].token_ids for r in ref], [o.outputs[0].token_ids for o in ours],
                   [top2_gaps_from_logprobs(r.outputs[0].logprobs) for r in ref])
    for o, r in zip(ours, ref):
        for a, b in zip(o.outputs[0].logprobs, r.outputs[0].logprobs):
            assert all(abs(a[t] - b[t]) < 1e-4 for t in set(a) & set(b))
    assert graphs.replays > 0
    assert {rows for rows, _ in graphs.entries} >= {16, 8, 4, 2, 1}
    padded.engine.check_integrity()


def test_a_sleep_and_wake_drops_the_graphs_bound_to_the_old_kv_cache(model_path, llm, prompts):
    """Wake allocates a new KV tensor (and moves GPU weights back): the path must not keep
    reading and writing the one it was built on."""
    from kvserve import LLM
    padded = LLM(model_path, dtype="float32", kv_cache_bytes=64 * 2**20, max_num_seqs=4)
    runner, mc = padded.engine.runner, padded.engine.model_config
    runner.decode_graphs = DecodeGraphs(runner.model, runner.kv_cache,
                                        lambda: get_backend("torch", mc.num_heads, mc.num_kv_heads, mc.head_dim),
                                        runner.block_size, 4, 2048 // runner.block_size, torch.device("cpu"),
                                        capture=False)
    greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    chosen = [{"prompt_token_ids": p} for p in prompts[:3]]
    first = padded.generate(chosen, greedy)
    padded.engine.sleep()
    padded.engine.wake()
    again = padded.generate(chosen, greedy)
    assert runner.decode_graphs.kv_cache is runner.kv_cache
    assert [o.outputs[0].token_ids for o in again] == [o.outputs[0].token_ids for o in first] == \
        [o.outputs[0].token_ids for o in llm.generate(chosen, greedy)]
