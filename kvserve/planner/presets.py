"""Built-in model presets: architecture numbers copied from each model's published
config.json (the ``source`` of each entry), keyed by lower-case hyphenated names."""
from __future__ import annotations

from types import MappingProxyType

from kvserve.planner.errors import PlannerInputError
from kvserve.planner.models import MLASpec, MoESpec, ModelSpec

HF = "https://huggingface.co/{}/blob/main/config.json"


def _llama(name: str, repo: str, layers: int, hidden: int, inter: int, heads: int, kv_heads: int,
           vocab: int, ctx: int) -> ModelSpec:
    return ModelSpec(name=name, num_layers=layers, hidden_size=hidden, intermediate_size=inter,
                     vocab_size=vocab, num_heads=heads, num_kv_heads=kv_heads, head_dim=hidden // heads,
                     max_context=ctx, source=HF.format(repo))


_PRESETS = [
    _llama("llama-2-7b", "meta-llama/Llama-2-7b-hf", 32, 4096, 11008, 32, 32, 32000, 4096),
    _llama("llama-3-8b", "meta-llama/Meta-Llama-3-8B", 32, 4096, 14336, 32, 8, 128256, 8192),
    _llama("llama-3.1-8b", "meta-llama/Llama-3.1-8B", 32, 4096, 14336, 32, 8, 128256, 131072),
    _llama("llama-3-70b", "meta-llama/Meta-Llama-3-70B", 80, 8192, 28672, 64, 8, 128256, 8192),
    _llama("llama-3.1-70b", "meta-llama/Llama-3.1-70B", 80, 8192, 28672, 64, 8, 128256, 131072),
    _llama("llama-3.1-405b", "meta-llama/Llama-3.1-405B", 126, 16384, 53248, 128, 8, 128256, 131072),
    ModelSpec(name="mixtral-8x7b", num_layers=32, hidden_size=4096, intermediate_size=14336,
              vocab_size=32000, num_heads=32, num_kv_heads=8, head_dim=128, max_context=32768,
              moe=MoESpec(num_experts=8, experts_per_token=2, expert_intermediate_size=14336),
              source=HF.format("mistralai/Mixtral-8x7B-v0.1")),
    ModelSpec(name="qwen2.5-72b", num_layers=80, hidden_size=8192, intermediate_size=29568,
              vocab_size=152064, num_heads=64, num_kv_heads=8, head_dim=128, max_context=32768,
              qkv_bias=True, source=HF.format("Qwen/Qwen2.5-72B")),
    ModelSpec(name="deepseek-v3", num_layers=61, hidden_size=7168, intermediate_size=18432,
              vocab_size=129280, num_heads=128, num_kv_heads=128, head_dim=192, max_context=163840,
              mla=MLASpec(kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128,
                          q_lora_rank=1536),
              moe=MoESpec(num_experts=256, experts_per_token=8, expert_intermediate_size=2048,
                          shared_intermediate_size=2048, first_dense_layers=3),
              native_dtype="fp8", source=HF.format("deepseek-ai/DeepSeek-V3")),
    ModelSpec(name="smollm2-135m", num_layers=30, hidden_size=576, intermediate_size=1536,
              vocab_size=49152, num_heads=9, num_kv_heads=3, head_dim=64, tie_word_embeddings=True,
              max_context=8192, source=HF.format("HuggingFaceTB/SmolLM2-135M")),
    ModelSpec(name="gemma-2b", num_layers=18, hidden_size=2048, intermediate_size=16384,
              vocab_size=256000, num_heads=8, num_kv_heads=1, head_dim=256, tie_word_embeddings=True,
              max_context=8192, source=HF.format("google/gemma-2b") + " (multi-query attention)"),
    ModelSpec(name="opt-13b", num_layers=40, hidden_size=5120, intermediate_size=20480,
              vocab_size=50272, num_heads=40, num_kv_heads=40, head_dim=128, tie_word_embeddings=True,
              max_context=2048, gated_mlp=False, native_dtype="fp16",
              source=HF.format("facebook/opt-13b")),
]

PRESETS = MappingProxyType({m.name: m for m in _PRESETS})


def preset(name: str) -> ModelSpec:
    """The preset called ``name`` (lower-case, hyphens)."""
    key = name.lower().replace("_", "-")
    if key not in PRESETS:
        raise PlannerInputError(f"unknown model preset {name!r}; choose from {sorted(PRESETS)}, "
                                "or pass a config.json / .gguf path", param="model")
    return PRESETS[key]
