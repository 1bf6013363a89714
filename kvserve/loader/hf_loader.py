"""Load a Hugging Face model folder (config.json + safetensors) into a :class:`Checkpoint`.

Weights come from ``model.safetensors``, from the shards listed in
``model.safetensors.index.json``, or failing both from every ``*.safetensors``
file in the folder. Tensors are converted to float32; names are already HF's.
"""
from __future__ import annotations

import json
import os
from typing import Any

import torch

from kvserve.config import MoEConfig, ModelConfig
from kvserve.errors import ModelLoadError
from kvserve.loader.checkpoint import Checkpoint, validate_tensors

# HF model_type / architectures entry -> our registry key.
_MODEL_TYPES = {"llama": "llama", "qwen2": "qwen2", "mistral": "mistral", "qwen2_moe": "qwen2_moe"}
_ARCH_CLASSES = {
    "LlamaForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
    "MistralForCausalLM": "mistral",
    "Qwen2MoeForCausalLM": "qwen2_moe",
}
_DEFAULT_ATTENTION_BIAS = {"llama": False, "qwen2": True, "mistral": False, "qwen2_moe": True}


def load_hf_folder(path: str) -> Checkpoint:
    """Read a Hugging Face folder: config.json (+ generation_config.json) and safetensors.

    Raises ModelLoadError when config.json or the weights are missing or
    unreadable, the architecture is not llama/qwen2/mistral/qwen2_moe, or the tensors do
    not fit the config.
    """
    raw = _read_json(os.path.join(path, "config.json"), required=True)
    generation = _read_json(os.path.join(path, "generation_config.json"), required=False)
    tensors = _load_safetensors(path)
    config = hf_config(raw, generation, has_lm_head="lm_head.weight" in tensors, path=path)
    if config.tie_word_embeddings:
        tensors.pop("lm_head.weight", None)
    validate_tensors(config, tensors, path)
    return Checkpoint(config=config, tensors=tensors, path=path, kind="hf")


def hf_config(raw: dict[str, Any], generation: dict[str, Any], has_lm_head: bool,
              path: str = "") -> ModelConfig:
    """Map a config.json dict (plus generation_config.json) to a ModelConfig.

    ``has_lm_head`` supplies the tying default when config.json does not say.
    """
    arch = _architecture(raw, path)

    def need(key: str) -> Any:
        if raw.get(key) is None:
            raise ModelLoadError(f"{path}/config.json lacks {key}", param="model")
        return raw[key]

    hidden = int(need("hidden_size"))
    num_heads = int(need("num_attention_heads"))
    num_kv_heads = raw.get("num_key_value_heads") or num_heads
    head_dim = raw.get("head_dim") or hidden // num_heads
    rope_theta, rope_scaling = _rope(raw)
    tie = raw.get("tie_word_embeddings")
    bias = raw.get("attention_bias")
    if bias is None:                    # Qwen2-MoE's config.json names it qkv_bias
        bias = raw.get("qkv_bias", _DEFAULT_ATTENTION_BIAS[arch])
    bos = raw.get("bos_token_id")
    if bos is None:
        bos = generation.get("bos_token_id")
    return ModelConfig(
        architecture=arch,
        vocab_size=int(need("vocab_size")),
        hidden_size=hidden,
        intermediate_size=int(need("intermediate_size")),
        num_layers=int(need("num_hidden_layers")),
        num_heads=num_heads,
        num_kv_heads=int(num_kv_heads),
        head_dim=int(head_dim),
        rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
        rope_theta=rope_theta,
        max_position_embeddings=int(raw.get("max_position_embeddings", 2048)),
        tie_word_embeddings=bool(tie) if tie is not None else not has_lm_head,
        attention_bias=bool(bias),
        bos_token_id=None if bos is None else int(bos),
        eos_token_ids=_eos_ids(raw.get("eos_token_id"), generation.get("eos_token_id")),
        rope_scaling=rope_scaling,
        name=os.path.basename(os.path.normpath(path)) if path else "",
        moe=_moe(raw, need) if arch == "qwen2_moe" else None,
    )


def _moe(raw: dict[str, Any], need) -> MoEConfig:
    """Qwen2-MoE's expert numbers (``need(key)`` raises ModelLoadError when one is absent)."""
    return MoEConfig(
        num_experts=int(need("num_experts")),
        top_k=int(need("num_experts_per_tok")),
        expert_intermediate_size=int(need("moe_intermediate_size")),
        shared_expert_intermediate_size=int(need("shared_expert_intermediate_size")),
        norm_topk_prob=bool(raw.get("norm_topk_prob", False)),
        decoder_sparse_step=int(raw.get("decoder_sparse_step") or 1),
        mlp_only_layers=tuple(int(i) for i in raw.get("mlp_only_layers") or ()),
    )


def _architecture(raw: dict[str, Any], path: str) -> str:
    """Registry key from model_type, else from the architectures list."""
    model_type = raw.get("model_type")
    if model_type in _MODEL_TYPES:
        return _MODEL_TYPES[model_type]
    for cls in raw.get("architectures") or []:
        if cls in _ARCH_CLASSES:
            return _ARCH_CLASSES[cls]
    raise ModelLoadError(
        f"{path}: unsupported model_type {model_type!r} / architectures "
        f"{raw.get('architectures')!r}; supported: {', '.join(_MODEL_TYPES)}", param="model")


def _rope(raw: dict[str, Any]) -> tuple[float, dict | None]:
    """(rope_theta, rope_scaling) from either the legacy keys or ``rope_parameters``.

    rope_scaling is None for plain ("default") rotary embeddings; otherwise an
    HF-style dict whose type is under ``"rope_type"``.
    """
    params = raw.get("rope_parameters") or {}
    theta = raw.get("rope_theta") or params.get("rope_theta") or 10000.0
    scaling = raw.get("rope_scaling") or params
    scaling = dict(scaling) if scaling else {}
    if "type" in scaling and "rope_type" not in scaling:
        scaling["rope_type"] = scaling.pop("type")
    scaling.pop("rope_theta", None)
    if scaling.get("rope_type", "default") == "default":
        return float(theta), None
    return float(theta), scaling


def _eos_ids(*values: Any) -> tuple[int, ...]:
    """Union, in order, of eos ids given as int, list of ints or None."""
    ids: list[int] = []
    for value in values:
        for item in (value if isinstance(value, list) else [value]):
            if item is not None and int(item) not in ids:
                ids.append(int(item))
    return tuple(ids)


def _read_json(file: str, required: bool) -> dict[str, Any]:
    """A JSON object from ``file``; {} when absent and not required."""
    if not os.path.isfile(file):
        if required:
            raise ModelLoadError(f"{os.path.dirname(file)} has no {os.path.basename(file)}",
                                 param="model")
        return {}
    try:
        with open(file, encoding="utf-8") as fh:
            data = json.load(fh)
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"cannot read {file}: {exc}", param="model") from exc
    if not isinstance(data, dict):
        raise ModelLoadError(f"{file} does not hold a JSON object", param="model")
    return data


def _safetensors_files(path: str) -> list[str]:
    """The weight files of a folder: index shards, model.safetensors, or all *.safetensors."""
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.isfile(index):
        weight_map = _read_json(index, required=True).get("weight_map") or {}
        return [os.path.join(path, f) for f in sorted(set(weight_map.values()))]
    single = os.path.join(path, "model.safetensors")
    if os.path.isfile(single):
        return [single]
    files = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
    if not files:
        raise ModelLoadError(f"{path} holds no *.safetensors weights (only safetensors "
                             "checkpoints are supported)", param="model")
    return [os.path.join(path, f) for f in files]


def _load_safetensors(path: str) -> dict[str, torch.Tensor]:
    """Every tensor of the folder, float32, under normalised HF names."""
    from safetensors import safe_open

    tensors: dict[str, torch.Tensor] = {}
    for file in _safetensors_files(path):
        if not os.path.isfile(file):
            raise ModelLoadError(f"weight shard {file} is missing", param="model")
        try:
            with safe_open(file, framework="pt") as handle:
                for key in handle.keys():
                    name = _normalise_name(key)
                    if name is not None:
                        tensors[name] = handle.get_tensor(key).to(torch.float32)
        except ModelLoadError:
            raise
        except Exception as exc:  # safetensors raises its own SafetensorError, OSError, ...
            raise ModelLoadError(f"cannot read {file} (truncated or corrupt?): {exc}",
                                 param="model") from exc
    return tensors


def _normalise_name(key: str) -> str | None:
    """HF tensor name with the ``model.`` prefix ensured; None for non-weights."""
    if key.endswith("rotary_emb.inv_freq"):
        return None
    if key.startswith(("model.", "lm_head.")):
        return key
    return "model." + key
