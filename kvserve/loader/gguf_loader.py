"""Load a llama.cpp GGUF file into a :class:`Checkpoint` (HF names, float32).

Every tensor is dequantised through ``gguf.quants.dequantize``, so any type the
installed ``gguf`` package can dequantise (F32, F16, BF16, Q8_0, Q4_0, Q4_1,
Q5_0, Q5_1, Q2_K..Q6_K, IQ*, ...) loads. Two layout facts matter:

- ggml lists dimensions fastest-first (``ne[0]`` is the contiguous one), so a
  torch shape is the GGUF shape reversed: GGUF ``[in, out]`` -> torch ``[out, in]``.
- llama.cpp's converter permutes the rows of Q and K (weights, and biases when
  present) of ``llama`` models from HF's rotate-half layout to interleaved
  pairs; we undo it so the tensors equal the Hugging Face ones. ``qwen2`` files
  are written unpermuted.

Row permutation, per head of ``d = head_dim`` rows (``d/2`` pairs)::

    HF rows:    [x0 .. x(d/2-1) | y0 .. y(d/2-1)]      (first half, second half)
    GGUF rows:  [x0 y0 x1 y1 .. x(d/2-1) y(d/2-1)]    (pairs interleaved)
"""
from __future__ import annotations

import os
import re
from typing import Any

import numpy as np
import torch

from kvserve.config import ModelConfig
from kvserve.errors import ModelLoadError
from kvserve.loader.gguf_dequant import dequantize_blocks
from kvserve.loader.gguf_file import GGUFTensorInfo, read_gguf, tensor_bytes
from kvserve.loader.checkpoint import Checkpoint, validate_tensors

GGUF_ARCHITECTURES = ("llama", "qwen2")

_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_BLOCK_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_BLOCK_RE = re.compile(r"^blk\.(\d+)\.([a-z_]+)\.(weight|bias)$")
# Tensors llama.cpp stores that HF does not (derived from config on the HF side).
_IGNORED_NAMES = frozenset({"rope_freqs.weight"})


def load_gguf(path: str, direct_types: tuple[str, ...] = ()) -> Checkpoint:
    """Read a GGUF file: config from its metadata, tensors dequantised to float32 --
    except decoder projection weights stored as one of ``direct_types`` (GGUF type
    names, e.g. ``("Q4_0", "Q4_1")``), which stay quantised (``kvserve.quant.gguf_blocks``).

    Raises ModelLoadError for a missing, truncated or corrupt file, an
    architecture other than llama/qwen2, or tensors that do not fit the config.
    """
    if not os.path.isfile(path):
        raise ModelLoadError(f"GGUF file not found: {path}", param="model")
    header = read_gguf(path)
    config = gguf_config(header.metadata, {t.name for t in header.tensors}, path)
    data = np.memmap(path, dtype=np.uint8, mode="r")
    tensors: dict[str, torch.Tensor] = {}
    for info in header.tensors:
        hf_name = hf_tensor_name(info.name)
        if hf_name is None:
            if info.name in _IGNORED_NAMES:
                continue
            raise ModelLoadError(f"GGUF file {path} holds an unsupported tensor {info.name!r}")
        direct = _direct_type(info, hf_name, direct_types)
        if direct:
            tensors[hf_name] = _read_quantized(info, data, direct, hf_name, config)
            continue
        weights = _dequantize(info, data, path)
        if config.architecture == "llama":
            weights = _maybe_unpermute(hf_name, weights, config)
        tensors[hf_name] = torch.from_numpy(weights)
    validate_tensors(config, tensors, path)
    return Checkpoint(config=config, tensors=tensors, path=path, kind="gguf")


def hf_tensor_name(gguf_name: str) -> str | None:
    """The Hugging Face name of a GGUF tensor, or None when it has no HF counterpart."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    match = _BLOCK_RE.match(gguf_name)
    if match is None or match.group(2) not in _BLOCK_NAMES:
        return None
    layer, part, kind = match.groups()
    return f"model.layers.{layer}.{_BLOCK_NAMES[part]}.{kind}"


def unpermute_rotary_rows(weights: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's Q/K row permutation (interleaved pairs -> HF halves).

    ``weights``: ``[n_head * head_dim, ...]`` (a weight or a bias). Returns a new
    contiguous array of the same shape. Inverse of llama.cpp's
    ``w.reshape(n_head, 2, d // 2, *rest).swapaxes(1, 2).reshape(w.shape)``.
    """
    rows = weights.shape[0]
    if rows % (2 * n_head) != 0:
        raise ModelLoadError(f"cannot un-permute {rows} rows over {n_head} heads")
    half = rows // n_head // 2
    w = weights.reshape(n_head, half, 2, *weights.shape[1:])  # [head, pair, 2, ...]
    return np.ascontiguousarray(w.swapaxes(1, 2)).reshape(weights.shape)


def gguf_config(fields: dict[str, Any], tensor_names: set[str], path: str) -> ModelConfig:
    """Build the ModelConfig from decoded GGUF metadata (see ``_read_metadata``).

    ``tensor_names`` (GGUF names) decides tying (tied iff there is no
    output.weight) and q/k/v biases (always for qwen2, else iff attn_q.bias exists).
    """
    arch = fields.get("general.architecture")
    if arch not in GGUF_ARCHITECTURES:
        raise ModelLoadError(
            f"GGUF file {path} has architecture {arch!r}; supported: {', '.join(GGUF_ARCHITECTURES)}",
            param="model")

    def need(key: str) -> Any:
        full = f"{arch}.{key}"
        if full not in fields:
            raise ModelLoadError(f"GGUF file {path} lacks metadata key {full}", param="model")
        return fields[full]

    hidden = int(need("embedding_length"))
    num_heads = int(need("attention.head_count"))
    num_kv_heads = _uniform_int(fields.get(f"{arch}.attention.head_count_kv", num_heads),
                                f"{arch}.attention.head_count_kv", path)
    head_dim = fields.get(f"{arch}.attention.key_length",
                          fields.get(f"{arch}.rope.dimension_count", hidden // num_heads))
    vocab_size = fields.get(f"{arch}.vocab_size", fields.get("tokenizer.ggml.tokens.length"))
    if vocab_size is None:
        raise ModelLoadError(f"GGUF file {path} gives no vocabulary size", param="model")
    return ModelConfig(
        architecture=arch,
        vocab_size=int(vocab_size),
        hidden_size=hidden,
        intermediate_size=_uniform_int(need("feed_forward_length"),
                                       f"{arch}.feed_forward_length", path),
        num_layers=int(need("block_count")),
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=int(head_dim),
        rms_norm_eps=float(need("attention.layer_norm_rms_epsilon")),
        rope_theta=float(fields.get(f"{arch}.rope.freq_base", 10000.0)),
        max_position_embeddings=int(need("context_length")),
        tie_word_embeddings="output.weight" not in tensor_names,
        attention_bias=(arch == "qwen2" or "blk.0.attn_q.bias" in tensor_names),
        bos_token_id=_opt_int(fields.get("tokenizer.ggml.bos_token_id")),
        eos_token_ids=_eos_ids(fields),
        rope_scaling=_rope_scaling(fields, arch),
        name=str(fields.get("general.name", os.path.basename(path))),
    )


def _dequantize(info: GGUFTensorInfo, data: np.ndarray, path: str) -> np.ndarray:
    """One GGUF tensor as a writable float32 array in torch (reversed) shape."""
    from gguf import GGMLQuantizationType, quants

    shape = tuple(reversed(info.shape))
    try:
        qtype = GGMLQuantizationType(info.type_id)
    except ValueError as exc:
        raise ModelLoadError(f"GGUF file {path}: tensor {info.name} has unknown type {info.type_id}") from exc
    raw = tensor_bytes(info, data)
    try:
        values = dequantize_blocks(raw, qtype.name, shape)        # the 4/8-bit types, whole-tensor
        if values is None:
            values = quants.dequantize(raw, qtype).astype(np.float32, copy=False).reshape(shape)
    except NotImplementedError as exc:
        raise ModelLoadError(f"GGUF file {path}: tensor {info.name} has type "
                             f"{qtype.name}, which gguf cannot dequantise") from exc
    except Exception as exc:
        raise ModelLoadError(f"GGUF file {path}: cannot read tensor {info.name} "
                             f"(truncated or corrupt?): {exc}") from exc
    if not values.flags.writeable or not values.flags.c_contiguous:
        values = np.array(values, dtype=np.float32, order="C")  # F32 data is a read-only memmap
    return values


def _direct_type(info: GGUFTensorInfo, hf_name: str, direct_types: tuple[str, ...]) -> str | None:
    """The GGUF type name of ``info`` if it is a projection weight kept quantised, else None."""
    if not direct_types or not hf_name.endswith("_proj.weight"):
        return None
    from gguf import GGMLQuantizationType
    try:
        name = GGMLQuantizationType(info.type_id).name
    except ValueError:
        return None
    return name if name in direct_types else None


def _read_quantized(info: GGUFTensorInfo, data: np.ndarray, type_name: str, hf_name: str,
                    config: ModelConfig):
    """A projection weight as its quantised blocks, rows un-permuted like the float path."""
    from kvserve.quant.gguf_blocks import read_blocks

    weight = read_blocks(tensor_bytes(info, data), type_name, tuple(reversed(info.shape)))
    if config.architecture == "llama" and (".q_proj." in hf_name or ".k_proj." in hf_name):
        heads = config.num_heads if ".q_proj." in hf_name else config.num_kv_heads
        weight = weight.rows(torch.from_numpy(unpermute_rotary_rows(np.arange(weight.shape[0]), heads)))
    return weight


def _maybe_unpermute(hf_name: str, weights: np.ndarray, config: ModelConfig) -> np.ndarray:
    """Undo the rotary row permutation on llama q_proj/k_proj tensors; others pass through."""
    if ".self_attn.q_proj." in hf_name:
        return unpermute_rotary_rows(weights, config.num_heads)
    if ".self_attn.k_proj." in hf_name:
        return unpermute_rotary_rows(weights, config.num_kv_heads)
    return weights


def _uniform_int(value: Any, key: str, path: str) -> int:
    """An int metadata value that may be stored per layer; per-layer values must agree."""
    if isinstance(value, list):
        if not value or len(set(value)) != 1:
            raise ModelLoadError(f"GGUF file {path}: per-layer {key} values {value[:4]}... "
                                 "differ; only uniform layers are supported", param="model")
        value = value[0]
    return int(value)


def _opt_int(value: Any) -> int | None:
    return None if value is None else int(value)


def _eos_ids(fields: dict[str, Any]) -> tuple[int, ...]:
    """End ids: ``eos_token_id`` then ``eot_token_id`` when distinct (chat end-of-turn)."""
    ids: list[int] = []
    for key in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id"):
        value = fields.get(key)
        if value is not None and int(value) not in ids:
            ids.append(int(value))
    return tuple(ids)


def _rope_scaling(fields: dict[str, Any], arch: str) -> dict | None:
    """HF-style rope_scaling dict from ``{arch}.rope.scaling.*``, or None."""
    kind = fields.get(f"{arch}.rope.scaling.type")
    if kind in (None, "none"):
        return None
    scaling: dict[str, Any] = {"rope_type": kind}
    factor = fields.get(f"{arch}.rope.scaling.factor")
    if factor is not None:
        scaling["factor"] = float(factor)
    original = fields.get(f"{arch}.rope.scaling.original_context_length")
    if original is not None:
        scaling["original_max_position_embeddings"] = int(original)
    return scaling
