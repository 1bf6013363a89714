"""KV-cache arithmetic of the planner, on top of the engine's own sizing formula
(:mod:`kvserve.engine.kv.sizing`, re-exported here): bytes per token = 2 (K and V) x
layers x kv_heads x (head_dim x dtype bytes + scale bytes per (token, kv head)).
"""
from __future__ import annotations

from kvserve.engine.kv.sizing import KVCachePlan, describe_bytes_per_token, kv_bytes_per_token, kv_cache_plan
from kvserve.planner.figures import Figure

__all__ = ["KVCachePlan", "kv_bytes_per_token", "kv_cache_plan", "kv_heads_per_gpu",
           "model_kv_bytes_per_token", "kv_bytes_per_token_per_gpu"]


# --------------------------------------------------------------------------------------
# Model-level KV arithmetic (the planner's view, reusing the engine's formula).
# --------------------------------------------------------------------------------------

def kv_heads_per_gpu(num_kv_heads: int, tp: int) -> int:
    """KV heads each tensor-parallel rank stores.

    ``tp`` must divide the KV heads (each rank owns ``kv_heads / tp``) or be a multiple of
    them (each head is replicated on ``tp / kv_heads`` ranks, as vLLM does): never uneven.
    """
    if tp <= 0:
        raise ValueError("tp must be positive")
    if num_kv_heads % tp == 0:
        return num_kv_heads // tp
    if tp % num_kv_heads == 0:
        return 1
    raise ValueError(f"tp={tp} splits {num_kv_heads} KV heads unevenly")


def model_kv_bytes_per_token(model, kv_dtype_bytes: float, scale_bytes: float = 0.0):
    """Logical KV bytes per token for the whole model (all layers, all heads), as a Figure.

    MHA/GQA/MQA: 2 x layers x kv_heads x (head_dim x bytes + scale bytes).
    MLA: layers x ((kv_lora_rank + qk_rope_head_dim) x bytes + scale bytes) (one latent
    shared by all heads, one scale per latent). ``scale_bytes`` is per (token, kv head).
    """
    if model.mla is not None:
        a = model.mla
        width = a.kv_lora_rank + a.qk_rope_head_dim
        value = model.num_layers * (width * kv_dtype_bytes + scale_bytes)
        scale = f" + {scale_bytes:g} B scale" if scale_bytes else ""
        text = (f"MLA latent: {model.num_layers} layers x ({a.kv_lora_rank} kv_lora_rank + "
                f"{a.qk_rope_head_dim} rope dim) x {kv_dtype_bytes:g} B{scale} = {value:,.0f} B")
        return Figure("kv_bytes_per_token", value, "B", text)
    value = kv_bytes_per_token(model.num_layers, model.num_kv_heads, model.head_dim, kv_dtype_bytes, scale_bytes)
    text = (describe_bytes_per_token(model.num_layers, model.num_kv_heads, model.head_dim, kv_dtype_bytes,
                                     scale_bytes).replace("2 x", "2 (K,V) x", 1)
            + f" ({model.attention_kind.upper()})")
    return Figure("kv_bytes_per_token", value, "B", text)


def kv_bytes_per_token_per_gpu(model, kv_dtype_bytes: float, tp: int, scale_bytes: float = 0.0):
    """KV bytes one token occupies on each tensor-parallel rank, as a Figure.

    GQA/MHA split KV heads across ranks (replicating when tp > kv_heads); the MLA latent
    is not split: every rank keeps the whole latent, so it does not shrink with TP.
    """
    if model.mla is not None:
        whole = model_kv_bytes_per_token(model, kv_dtype_bytes, scale_bytes)
        return Figure("kv_bytes_per_token_per_gpu", whole.value, "B",
                      f"MLA latent is replicated on all {tp} ranks: {whole.value:,.0f} B per GPU")
    heads = kv_heads_per_gpu(model.num_kv_heads, tp)
    value = kv_bytes_per_token(model.num_layers, heads, model.head_dim, kv_dtype_bytes, scale_bytes)
    how = (f"{model.num_kv_heads} kv_heads / TP {tp} = {heads}" if model.num_kv_heads % tp == 0
           else f"TP {tp} > {model.num_kv_heads} kv_heads: each rank keeps 1 replicated head")
    return Figure("kv_bytes_per_token_per_gpu", value, "B",
                  f"{how}; {_short_formula(model.num_layers, heads, model.head_dim, kv_dtype_bytes, scale_bytes)} "
                  f"= {value:,.0f} B per GPU")


def _short_formula(layers: int, heads: int, head_dim: int, dtype_bytes: float, scale_bytes: float) -> str:
    """``2 x 30 x 3 x 64 x 4 B`` or, with scales, ``2 x 30 x 3 x (64 x 1 B + 4 B scale)``."""
    if not scale_bytes:
        return f"2 x {layers} x {heads} x {head_dim} x {dtype_bytes:g} B"
    return f"2 x {layers} x {heads} x ({head_dim} x {dtype_bytes:g} B + {scale_bytes:g} B scale)"
