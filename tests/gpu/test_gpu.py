"""Tier 3: the bf16 GPU path (skipped without CUDA)."""
from __future__ import annotations

import pytest
import torch

from kvserve.sampling.params import SamplingParams

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def test_bf16_greedy_close_to_fp32_cpu(model_path, llm, prompts):
    from kvserve import LLM
    gpu = LLM(model_path, device="cuda", kv_cache_bytes=2**30)
    assert gpu.engine.dtype == torch.bfloat16
    greedy = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    chosen = [{"prompt_token_ids": p} for p in prompts[:8]]
    ours = gpu.generate(chosen, greedy)
    ref = llm.generate(chosen, greedy)
    # bf16 is not bit-exact with fp32: require the first tokens to agree on most prompts.
    agree = sum(o.outputs[0].token_ids[:4] == r.outputs[0].token_ids[:4] for o, r in zip(ours, ref))
    assert agree >= 6
    gpu.engine.check_integrity()


def test_fp32_gpu_matches_cpu(model_path, llm, prompts):
    from kvserve import LLM
    gpu = LLM(model_path, device="cuda", dtype="float32", kv_cache_bytes=2**30)
    greedy = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=2)
    chosen = [{"prompt_token_ids": p} for p in prompts[:16]]
    from tests.support.parity import compare_greedy, top2_gaps_from_logprobs
    ref = llm.generate(chosen, greedy)
    ours = gpu.generate(chosen, greedy)
    compare_greedy([r.outputs[0].token_ids for r in ref], [o.outputs[0].token_ids for o in ours],
                   [top2_gaps_from_logprobs(r.outputs[0].logprobs) for r in ref])


def test_lora_fp32_gpu_matches_cpu(model_path, prompts, tmp_path):
    """Adapters batched on the GPU give the CPU engine's greedy tokens (fp32 both)."""
    from kvserve import LLM, LoRARequest
    from tests.support.lora_adapters import hf_base_model, make_adapter
    from tests.support.parity import compare_greedy, top2_gaps_from_logprobs
    base = hf_base_model(model_path)
    loras = [LoRARequest(f"a{i}", make_adapter(base, str(tmp_path / f"a{i}"), r=8, seed=i,
                                              targets=("q_proj", "v_proj", "down_proj"))) for i in range(3)]
    chosen = [{"prompt_token_ids": p} for p in prompts[:12]]
    per_prompt = [loras[i % 3] if i % 4 else None for i in range(len(chosen))]
    greedy = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=2)
    runs = []
    for device in ("cpu", "cuda"):
        engine = LLM(model_path, device=device, dtype="float32", kv_cache_bytes=2**28, enable_lora=True, max_loras=2)
        runs.append(engine.generate(chosen, greedy, lora_request=per_prompt))
        engine.engine.check_integrity()
    ref, ours = runs
    compare_greedy([r.outputs[0].token_ids for r in ref], [o.outputs[0].token_ids for o in ours],
                   [top2_gaps_from_logprobs(r.outputs[0].logprobs) for r in ref])


@pytest.mark.parametrize("scheme", ["int8", "int4"])
def test_quantised_kernels_on_cuda_match_the_cpu_reference(scheme):
    """The CUDA int8 / int4 kernels against float64 on the same codes (the CPU bound)."""
    from kvserve.quant.formats import Int4Weight, as_format
    from kvserve.quant.kernels import COMPUTE_DTYPE, make_kernel
    w = torch.randn(256, 256, generator=torch.Generator().manual_seed(0)) * 0.05
    q = as_format(w, scheme)
    x = torch.randn(8, 256, generator=torch.Generator().manual_seed(1))
    got = make_kernel(q, torch.device("cuda"))(x.cuda()).double().cpu()
    deq = q.dequantize() if scheme == "int8" else Int4Weight(
        q.codes, q.scales.bfloat16().float(), q.zeros.bfloat16().float(), q.group_size).dequantize()
    x_in = x.to(COMPUTE_DTYPE).double()
    assert bool(((got - x_in @ deq.t()).abs() <= (x_in.abs() @ deq.abs().t()) * 2.0 ** -7 + 1e-6).all())


def test_int4_engine_on_cuda(model_path, prompts):
    from kvserve import LLM
    gpu = LLM(model_path, device="cuda", quantization="int4", kv_cache_dtype="int8", kv_cache_bytes=2**30)
    out = gpu.generate([{"prompt_token_ids": p} for p in prompts[:4]],
                       SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    assert all(len(o.outputs[0].token_ids) == 8 for o in out)
    assert gpu.engine.runner.model.weight_layouts["down_proj"] == "int4"
    assert gpu.engine.runner.decode_graphs.entries, "int4 weights + int8 KV decode steps were not captured"
    gpu.engine.check_integrity()


def test_decode_graphs_match_eager_on_cuda(model_path, prompts):
    """fp32 on the GPU: decode steps replayed as CUDA graphs give the eager engine's greedy
    tokens and logprobs, while the batch shrinks through the buckets as requests end."""
    from kvserve import LLM
    from tests.support.parity import compare_greedy, top2_gaps_from_logprobs
    kwargs = dict(device="cuda", dtype="float32", kv_cache_bytes=2**30, max_num_seqs=16)
    eager = LLM(model_path, cuda_graphs=False, **kwargs)
    graphed = LLM(model_path, **kwargs)
    assert eager.engine.runner.decode_graphs is None
    chosen = [{"prompt_token_ids": p} for p in prompts[:12]]
    params = [SamplingParams(temperature=0, max_tokens=6 + 3 * i, ignore_eos=True, logprobs=2) for i in range(12)]
    ref = eager.generate(chosen, params)
    ours = graphed.generate(chosen, params)
    compare_greedy([r.outputs[0].token_ids for r in ref], [o.outputs[0].token_ids for o in ours],
                   [top2_gaps_from_logprobs(r.outputs[0].logprobs) for r in ref])
    for o, r in zip(ours, ref):
        for a, b in zip(o.outputs[0].logprobs, r.outputs[0].logprobs):
            assert all(abs(a[t] - b[t]) < 1e-4 for t in set(a) & set(b))
    graphs = graphed.engine.runner.decode_graphs
    assert {rows for rows, _ in graphs.entries} >= {16, 8, 4, 2, 1}
    assert all(e.graph is not None for e in graphs.entries.values())
    graphed.engine.check_integrity()


def test_decode_graphs_follow_a_sleep_wake_and_a_weight_load(model_path, prompts):
    """Wake reallocates the KV cache and moves the weights back; a weight load replaces the
    model: the graphs captured before are dropped and captured again, outputs unchanged."""
    from kvserve import LLM
    gpu = LLM(model_path, device="cuda", dtype="float32", kv_cache_bytes=2**30, max_num_seqs=4)
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    chosen = [{"prompt_token_ids": p} for p in prompts[:3]]
    first = [o.outputs[0].token_ids for o in gpu.generate(chosen, greedy)]
    graphs = gpu.engine.runner.decode_graphs
    captured = dict(graphs.entries)
    assert captured
    gpu.engine.sleep()
    gpu.engine.wake()
    assert [o.outputs[0].token_ids for o in gpu.generate(chosen, greedy)] == first
    assert graphs.kv_cache is gpu.engine.runner.kv_cache and graphs.entries
    assert all(graphs.entries[k] is not captured[k] for k in graphs.entries if k in captured)
    gpu.engine.load_weights(model_path)
    assert [o.outputs[0].token_ids for o in gpu.generate(chosen, greedy)] == first
    assert graphs.model is gpu.engine.runner.model
