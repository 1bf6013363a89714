"""The loaded-checkpoint record and the checks every loader applies to it.

Every loader returns the same thing: a :class:`Checkpoint` whose tensors use
Hugging Face Llama names, float32, in Hugging Face layout (``[out, in]`` for
linear weights), whatever the file format was.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from kvserve.config import ModelConfig
from kvserve.errors import ModelLoadError

SUPPORTED_ARCHITECTURES = ("llama", "qwen2", "mistral", "qwen2_moe")


@dataclass
class Checkpoint:
    """A model's architecture numbers and weights, format-independent.

    ``tensors`` maps Hugging Face Llama names (``model.layers.0.self_attn.q_proj.weight``)
    to float32 tensors in HF layout. ``lm_head.weight`` is absent exactly when
    ``config.tie_word_embeddings`` is true. ``kind`` is ``"gguf"`` or ``"hf"``.
    """

    config: ModelConfig
    tensors: dict[str, torch.Tensor]
    path: str
    kind: str


def expected_tensor_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """The name -> shape map a checkpoint with ``config`` must hold exactly."""
    hidden = config.hidden_size
    q_rows = config.num_heads * config.head_dim
    kv_rows = config.num_kv_heads * config.head_dim
    shapes: dict[str, tuple[int, ...]] = {
        "model.embed_tokens.weight": (config.vocab_size, hidden),
        "model.norm.weight": (hidden,),
    }
    if not config.tie_word_embeddings:
        shapes["lm_head.weight"] = (config.vocab_size, hidden)
    for i in range(config.num_layers):
        p = f"model.layers.{i}."
        shapes[p + "input_layernorm.weight"] = (hidden,)
        shapes[p + "post_attention_layernorm.weight"] = (hidden,)
        shapes[p + "self_attn.q_proj.weight"] = (q_rows, hidden)
        shapes[p + "self_attn.k_proj.weight"] = (kv_rows, hidden)
        shapes[p + "self_attn.v_proj.weight"] = (kv_rows, hidden)
        shapes[p + "self_attn.o_proj.weight"] = (hidden, q_rows)
        shapes.update(_mlp_shapes(config, i, p + "mlp."))
        if config.attention_bias:
            shapes[p + "self_attn.q_proj.bias"] = (q_rows,)
            shapes[p + "self_attn.k_proj.bias"] = (kv_rows,)
            shapes[p + "self_attn.v_proj.bias"] = (kv_rows,)
    return shapes


def _swiglu_shapes(prefix: str, hidden: int, inter: int) -> dict[str, tuple[int, ...]]:
    return {prefix + "gate_proj.weight": (inter, hidden), prefix + "up_proj.weight": (inter, hidden),
            prefix + "down_proj.weight": (hidden, inter)}


def _mlp_shapes(config: ModelConfig, layer: int, prefix: str) -> dict[str, tuple[int, ...]]:
    """The MLP tensors of one layer: a dense SwiGLU, or Qwen2-MoE's router, experts and
    sigmoid-gated shared expert."""
    hidden, moe = config.hidden_size, config.moe
    if moe is None or not moe.is_sparse(layer):
        return _swiglu_shapes(prefix, hidden, config.intermediate_size)
    shapes = {prefix + "gate.weight": (moe.num_experts, hidden)}
    for e in range(moe.num_experts):
        shapes.update(_swiglu_shapes(f"{prefix}experts.{e}.", hidden, moe.expert_intermediate_size))
    if moe.shared_expert_intermediate_size:
        shapes.update(_swiglu_shapes(prefix + "shared_expert.", hidden, moe.shared_expert_intermediate_size))
        shapes[prefix + "shared_expert_gate.weight"] = (1, hidden)
    return shapes


def validate_tensors(config: ModelConfig, tensors: dict[str, torch.Tensor], path: str) -> None:
    """Raise ModelLoadError unless ``tensors`` holds exactly the expected names and shapes.

    Catches a config read wrongly (shape mismatch), a checkpoint with missing
    weights, and tensors of a kind the model code would silently ignore.
    """
    expected = expected_tensor_shapes(config)
    missing = sorted(set(expected) - set(tensors))
    if missing:
        raise ModelLoadError(
            f"checkpoint {path} lacks {len(missing)} expected tensor(s), e.g. {missing[:3]}")
    extra = sorted(set(tensors) - set(expected))
    if extra:
        raise ModelLoadError(
            f"checkpoint {path} holds {len(extra)} tensor(s) this {config.architecture} "
            f"model does not use, e.g. {extra[:3]}")
    for name, shape in expected.items():
        actual = tuple(tensors[name].shape)
        if actual != shape:
            raise ModelLoadError(
                f"checkpoint {path}: tensor {name} has shape {list(actual)}, "
                f"the config implies {list(shape)}")
