"""The planner against published figures. Each test names its source.

All sources are public; where a figure is derived (e.g. a vLLM log line), the derivation
from the published numbers is written next to the assertion.
"""
from __future__ import annotations

import math
from types import MappingProxyType

import pytest

from kvserve.planner.candidates import PlanInputs
from kvserve.planner.dtypes import kv_dtype, weight_dtype
from kvserve.planner.fleet import usd_per_million_tokens
from kvserve.planner.hardware import CATALOG, HardwareSpec
from kvserve.planner.kv_memory import kv_cache_plan, model_kv_bytes_per_token
from kvserve.planner.memory import weight_bytes
from kvserve.planner.models import active_params, param_counts
from kvserve.planner.plan import make_plan
from kvserve.planner.presets import preset
from kvserve.planner.roofline import cost_model, decode_work, ridge_batch, step_time
from kvserve.planner.speculative import expected_tokens_per_step, leviathan_speedup, speculative
from kvserve.planner.workload import SpecConfig, Workload

GiB = 2**30
BF16 = kv_dtype("bf16")


def kv_per_token(name: str, dtype: str = "bf16") -> float:
    return model_kv_bytes_per_token(preset(name), kv_dtype(dtype).bytes).value


def test_llama3_70b_kv_bytes_per_token_and_4k_sequence():
    # Source: IETF draft-calabria-bmwg-ai-fabric-inference-bench, appendix "70B parameter model at
    # FP16 with 4K context": S_KV = 2 x 80 x 8 x 128 x 4,096 x 2 = 1,342,177,280 bytes.
    # (Equivalently 327,680 B = 320 KiB per token, the widely quoted Llama-3-70B figure.)
    assert kv_per_token("llama-3-70b") == 327_680
    assert kv_per_token("llama-3-70b") * 4096 == 1_342_177_280


def test_llama31_70b_kv_at_128k_context():
    # Source: Spheron, "KV cache optimization guide" table for Llama 3.1 70B at BF16:
    # 131,072 tokens -> ~42.9 GB for one user, ~343 GB for 8 users.
    one = kv_per_token("llama-3.1-70b") * 131_072
    assert one / 1e9 == pytest.approx(42.9, abs=0.1)
    assert 8 * one / 1e9 == pytest.approx(343, abs=1)


def test_llama2_7b_mha_kv_is_half_a_mebibyte_per_token():
    # Source: NVIDIA Technical Blog, "Mastering LLM Techniques: Inference Optimization" (2023):
    # Llama 2 7B, batch 1, 4096 tokens, fp16: 1 x 4096 x 2 x 32 x 4096 x 2 bytes = ~2 GB.
    # Also systemoverflow.com: "approximately 524,288 bytes per token" for a 32-layer 7B model.
    assert kv_per_token("llama-2-7b") == 524_288
    assert kv_per_token("llama-2-7b") * 4096 == 2 * GiB


def test_opt13b_kv_is_800kb_per_token():
    # Source: Kwon et al., "Efficient Memory Management for Large Language Model Serving with
    # PagedAttention" (SOSP 2023), section 3: "the KV cache of a single token demands 800 KB of
    # space, calculated as 2 (key and value vectors) x 5120 (hidden state size) x 40 (number of
    # layers) x 2 (bytes per FP16)"; 2048 tokens -> "as much as 1.6 GB".
    assert kv_per_token("opt-13b") == 819_200
    assert kv_per_token("opt-13b") * 2048 / 1e9 == pytest.approx(1.68, abs=0.1)


def test_deepseek_v3_mla_latent_cache():
    # Sources: DeepSeek-V2 paper (arXiv 2405.04434) Table 1: MLA caches (d_c + d_h^R) x l elements
    # per token, with d_c = 4 d_h and d_h^R = d_h / 2, "equal to GQA with only 2.25 groups";
    # DeepSeek-V3 config.json: kv_lora_rank 512, qk_rope_head_dim 64, 61 layers.
    m = preset("deepseek-v3")
    per_layer_elements = model_kv_bytes_per_token(m, 1).value / m.num_layers
    assert per_layer_elements == 512 + 64 == 4.5 * 128
    assert per_layer_elements == 2 * 2.25 * 128                      # GQA with 2.25 groups, d_h = 128
    assert kv_per_token("deepseek-v3") == 61 * 576 * 2 == 70_272      # bf16
    # MLA does not shrink with tensor parallelism (the latent is replicated on every rank).
    from kvserve.planner.kv_memory import kv_bytes_per_token_per_gpu
    assert kv_bytes_per_token_per_gpu(m, 2, 8).value == 70_272
    assert kv_bytes_per_token_per_gpu(preset("llama-3-70b"), 2, 8).value == 327_680 / 8


def test_vllm_kv_blocks_and_max_concurrency_llama31_8b_rtx3090():
    # Source: vllm-project/vllm issue #10517 (Llama-3.1-8B-Instruct, RTX 3090, gpu_memory_utilization 0.90):
    #   max_model_len 20000: "kv_cache_size=3.81GiB", "# GPU blocks: 1952",
    #   "Maximum concurrency for 20000 tokens per request: 1.56x";
    #   max_model_len 29000: "kv_cache_size=2.89GiB", "# GPU blocks: 1478", "maximum number of
    #   tokens that can be stored in KV cache (23648)" -> refused (29000 > 23648).
    m = preset("llama-3.1-8b")
    plan = kv_cache_plan(3.8125 * GiB, m.num_layers, m.num_kv_heads, m.head_dim, 2, 16, 20_000)
    assert plan.bytes_per_token == 131_072
    assert plan.num_blocks == 1952 and plan.max_tokens == 31_232
    assert round(plan.max_tokens / 20_000, 2) == 1.56
    assert plan.max_seqs_at_full_context == 1
    # The printed 3.81 GiB is rounded; any budget that prints as 3.81 gives 1952 +- 3 blocks.
    assert abs(kv_cache_plan(3.81 * GiB, 32, 8, 128, 2, 16, 20_000).num_blocks - 1952) <= 3
    short = kv_cache_plan(2.89 * GiB, 32, 8, 128, 2, 16, 29_000)
    assert abs(short.max_tokens - 23_648) <= 32 and short.max_seqs_at_full_context == 0


def test_vllm_weight_bytes_llama31_8b_bf16_and_70b_w8a8():
    # Sources: vllm issue #10517 "Loading model weights took 14.9888 GB" (Llama-3.1-8B bf16) and
    # vllm PR #12569 "Loading model weights took 67.7229 GB" for Llama-3.1-70B-Instruct w8a8,
    # "# GPU blocks: 1381", "Maximum concurrency for 2048 tokens per request: 10.79x".
    # vLLM's "GB" there is GiB (bytes / 2**30). w8a8 keeps the embedding and LM head in bf16.
    assert weight_bytes(preset("llama-3.1-8b"), weight_dtype("bf16")).value / GiB == pytest.approx(14.9888, rel=0.005)
    assert weight_bytes(preset("llama-3.1-70b"), weight_dtype("int8")).value / GiB == pytest.approx(67.7229, rel=0.005)
    assert round(1381 * 16 / 2048, 2) == 10.79
    assert kv_cache_plan(1381 * 16 * 327_680, 80, 8, 128, 2, 16, 2048).num_blocks == 1381


def test_moe_total_and_active_parameters():
    # Sources: Mistral AI, "Mixtral of experts" (Dec 2023): "46.7B total parameters but only uses
    # 12.9B parameters per token"; DeepSeek-V3 Technical Report (arXiv 2412.19437): "671B total
    # parameters with 37B activated for each token".
    mixtral, ds = preset("mixtral-8x7b"), preset("deepseek-v3")
    assert param_counts(mixtral).total / 1e9 == pytest.approx(46.7, abs=0.05)
    assert active_params(mixtral) / 1e9 == pytest.approx(12.9, abs=0.05)
    assert param_counts(ds).total / 1e9 == pytest.approx(671, rel=0.002)
    assert active_params(ds) / 1e9 == pytest.approx(37, rel=0.03)


def test_dense_parameter_counts_from_model_cards():
    # Sources: Qwen2.5-72B model card ("Number of Parameters: 72.7B; Number of Paramaters
    # (Non-Embedding): 70.0B"); Meta Llama 3.1 model card (405B); Meta Llama 3 (8B, 70B);
    # Llama 2 paper (7B = 6.7B parameters); SmolLM2-135M model card.
    qwen = param_counts(preset("qwen2.5-72b"))
    assert qwen.total / 1e9 == pytest.approx(72.7, abs=0.05)
    assert qwen.body / 1e9 == pytest.approx(70.0, abs=0.25)       # 70.21B computed; the card rounds down
    assert param_counts(preset("llama-3.1-405b")).total / 1e9 == pytest.approx(405, rel=0.005)
    assert param_counts(preset("llama-3-8b")).total / 1e9 == pytest.approx(8.03, abs=0.01)
    assert param_counts(preset("llama-3-70b")).total / 1e9 == pytest.approx(70.6, abs=0.05)
    assert param_counts(preset("llama-2-7b")).total / 1e9 == pytest.approx(6.74, abs=0.01)
    assert param_counts(preset("smollm2-135m")).total / 1e6 == pytest.approx(134.5, abs=0.1)


def _custom_gpu(bandwidth: float, flops: float) -> HardwareSpec:
    return HardwareSpec(name="custom", memory_bytes=80e9, mem_bandwidth=bandwidth,
                        flops=MappingProxyType({"bf16": flops}), mem_efficiency=1.0, kv_efficiency=1.0,
                        flops_efficiency=1.0)


def test_decode_bound_7b_on_2tb_per_s():
    # Source: Databricks / MosaicML, "LLM Inference Performance Engineering: Best Practices" (2023):
    # a 7B model in 16-bit moves 14 GB of parameters per token; on a 2 TB/s machine the best
    # possible TPOT is 14 GB / 2 TB/s = 7 ms ("a TPOT of 14 ms ... is an MBU of 50%").
    # Llama-2-7B has 6.74B parameters; 6.61B are streamed per token (the input embedding is only
    # indexed), i.e. 13.2 GB -> 6.6 ms, the blog's "7B ~ 14 GB -> 7 ms" before rounding.
    cm = cost_model(preset("llama-2-7b"), _custom_gpu(2e12, 312e12), weight_dtype("bf16"), BF16, 1)
    t = step_time(cm, decode_work(1, 1), peak=True).total_s
    streamed = (param_counts(preset("llama-2-7b")).total - 32000 * 4096) * 2
    assert t == pytest.approx(streamed / 2e12, rel=0.001)
    assert t * 1e3 == pytest.approx(7.0, rel=0.06)
    assert 14e-3 / t == pytest.approx(2.0, rel=0.06)                 # a 14 ms TPOT -> MBU ~50%


def test_ridge_point_a100_ops_per_byte():
    # Source: kipply, "Transformer Inference Arithmetic" (2022): A100 312e12 FLOPS / 1.5e12 B/s
    # = 208 FLOPs per byte; with 2-byte weights and 2 FLOPs per weight per token, decode turns
    # compute-bound at batch ~208.
    cm = cost_model(preset("llama-3-70b"), _custom_gpu(1.5e12, 312e12), weight_dtype("bf16"), BF16, 1)
    assert ridge_batch(cm).value == pytest.approx(208, rel=0.01)
    # And for the catalog H100 SXM (989 TFLOPS bf16 dense / 3.35 TB/s): ~295.
    h100 = cost_model(preset("llama-3-70b"), CATALOG["h100-sxm"], weight_dtype("bf16"), BF16, 4)
    assert ridge_batch(h100).value == pytest.approx(295, rel=0.01)


def test_usd_per_million_tokens_published_examples():
    # Source: GMI Cloud, "Cost Per Million Tokens Explained": "$2.00 / (85 x 3,600) x 1,000,000 =
    # $6.54 per 1M tokens" (70B dense, 1x H100 at $2.00/GPU-hour, ~85 tokens/s).
    assert usd_per_million_tokens(2.00, 85).value == pytest.approx(6.54, abs=0.01)
    # Source: neelmishra.github.io "LLM Inference Cost": Llama-2 70B on 4x A100 at $2.21/GPU-hour,
    # 2,400 tokens/s at 70% utilisation -> $1.46 / 1M tokens.
    assert usd_per_million_tokens(4 * 2.21, 2400 * 0.7).value == pytest.approx(1.46, abs=0.01)


def test_speculative_expected_tokens_and_speedup():
    # Source: Leviathan, Kalman, Matias, "Fast Inference from Transformers via Speculative
    # Decoding" (ICML 2023), eq. (1): E[#tokens per step] = (1 - a^(g+1)) / (1 - a), and
    # Theorem 3.8: walltime improvement (1 - a^(g+1)) / ((1 - a)(g c + 1)).
    # Worked example (torchedup.dev "spec-decoding-effective-speedup"): a=0.8, k=4 ->
    # E[accepted drafts] = 0.8 (1 - 0.8^4) / 0.2 = 2.3616, i.e. 3.3616 tokens with the bonus one.
    assert expected_tokens_per_step(0.8, 4).value == pytest.approx(3.3616, abs=1e-4)
    assert expected_tokens_per_step(0.8, 4).value - 1 == pytest.approx(2.3616, abs=1e-4)
    assert leviathan_speedup(0.8, 4, 0.1) == pytest.approx(3.3616 / 1.4, abs=1e-4)
    assert expected_tokens_per_step(0.8, 200).value == pytest.approx(1 / (1 - 0.8), rel=1e-6)
    assert expected_tokens_per_step(1.0, 4).value == 5
    # At batch 1 the verify pass is memory-bound like a decode step, so the planner's speedup
    # matches Leviathan's closed form; at large batch it stops paying.
    cm = cost_model(preset("llama-3-70b"), CATALOG["h100-sxm"], weight_dtype("bf16"), BF16, 4)
    spec = SpecConfig(0.8, 4, 0.1)
    res = speculative(cm, spec, batch=1, context=2048)
    assert res.speedup.value == pytest.approx(leviathan_speedup(0.8, 4, 0.1), rel=0.05)
    assert 1 < res.breakeven_batch.value < 1000


def test_plan_llama3_70b_h100_vs_h200():
    # The worked example of docs/planner.md: 32 x 8k sequences. H100 80GB needs TP 4 (TP 2 leaves
    # ~4 GiB of KV per GPU), H200 141GB fits them at TP 2.
    w = Workload(context=8192, concurrency=32)
    h100 = make_plan(PlanInputs(preset("llama-3-70b"), CATALOG["h100-sxm"], weight_dtype("bf16"), BF16, w))
    h200 = make_plan(PlanInputs(preset("llama-3-70b"), CATALOG["h200"], weight_dtype("bf16"), BF16, w))
    assert int(h100.figure("tp").value) == 4 and int(h200.figure("tp").value) == 2
    assert h100.figure("max_concurrency").value >= 32 and h200.figure("max_concurrency").value >= 32
    assert h100.figure("weight_bytes").value / 1e9 == pytest.approx(141.1, abs=0.1)
    assert math.isclose(h100.figure("kv_bytes_per_token").value, 327_680)
