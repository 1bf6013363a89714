"""KV-cache arithmetic shared by the engine's memory sizing and the planner.

One formula: bytes per token = 2 (K and V) x layers x kv_heads x head_dim x dtype bytes.
"""
from __future__ import annotations

from dataclasses import dataclass

from kvserve.planner.figures import Figure


def kv_bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, dtype_bytes: float) -> float:
    """Bytes of KV cache one token occupies across all layers (K and V)."""
    if min(num_layers, num_kv_heads, head_dim) <= 0 or dtype_bytes <= 0:
        raise ValueError("layers, kv_heads, head_dim and dtype_bytes must be positive")
    return 2 * num_layers * num_kv_heads * head_dim * dtype_bytes


@dataclass(frozen=True)
class KVCachePlan:
    """How a KV memory budget splits into blocks, with the arithmetic that produced it."""

    bytes_per_token: float
    block_size: int
    bytes_per_block: float
    num_blocks: int
    max_tokens: int
    max_seqs_at_full_context: int
    explanation: str


def kv_cache_plan(budget_bytes: float, num_layers: int, num_kv_heads: int, head_dim: int,
                  dtype_bytes: float, block_size: int, max_context: int) -> KVCachePlan:
    """Split ``budget_bytes`` of KV memory into ``block_size``-token blocks.

    ``max_seqs_at_full_context`` counts sequences of ``max_context`` tokens that fit at once.
    """
    per_token = kv_bytes_per_token(num_layers, num_kv_heads, head_dim, dtype_bytes)
    per_block = per_token * block_size
    num_blocks = int(budget_bytes // per_block)
    max_tokens = num_blocks * block_size
    blocks_per_seq = -(-max_context // block_size)
    max_seqs = num_blocks // blocks_per_seq if blocks_per_seq else 0
    explanation = (
        f"KV bytes/token = 2 x {num_layers} layers x {num_kv_heads} kv_heads x {head_dim} head_dim "
        f"x {dtype_bytes:g} B = {per_token:,.0f} B; block = {block_size} tokens = {per_block:,.0f} B; "
        f"budget {budget_bytes / 2**20:,.1f} MiB -> {num_blocks} blocks = {max_tokens:,} tokens; "
        f"at full context {max_context:,} ({blocks_per_seq} blocks/seq) -> {max_seqs} concurrent sequences"
    )
    return KVCachePlan(per_token, block_size, per_block, num_blocks, max_tokens, max_seqs, explanation)


# --------------------------------------------------------------------------------------
# Model-level KV arithmetic (the planner's view; the two functions above stay the
# engine's entry points and are reused here).
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


def model_kv_bytes_per_token(model, kv_dtype_bytes: float):
    """Logical KV bytes per token for the whole model (all layers, all heads), as a Figure.

    MHA/GQA/MQA: 2 x layers x kv_heads x head_dim x bytes.
    MLA: layers x (kv_lora_rank + qk_rope_head_dim) x bytes (one latent shared by all heads).
    """
    if model.mla is not None:
        a = model.mla
        value = model.num_layers * (a.kv_lora_rank + a.qk_rope_head_dim) * kv_dtype_bytes
        text = (f"MLA latent: {model.num_layers} layers x ({a.kv_lora_rank} kv_lora_rank + "
                f"{a.qk_rope_head_dim} rope dim) x {kv_dtype_bytes:g} B = {value:,.0f} B")
        return Figure("kv_bytes_per_token", value, "B", text)
    value = kv_bytes_per_token(model.num_layers, model.num_kv_heads, model.head_dim, kv_dtype_bytes)
    text = (f"2 (K,V) x {model.num_layers} layers x {model.num_kv_heads} kv_heads x {model.head_dim} "
            f"head_dim x {kv_dtype_bytes:g} B = {value:,.0f} B ({model.attention_kind.upper()})")
    return Figure("kv_bytes_per_token", value, "B", text)


def kv_bytes_per_token_per_gpu(model, kv_dtype_bytes: float, tp: int):
    """KV bytes one token occupies on each tensor-parallel rank, as a Figure.

    GQA/MHA split KV heads across ranks (replicating when tp > kv_heads); the MLA latent
    is not split: every rank keeps the whole latent, so it does not shrink with TP.
    """
    if model.mla is not None:
        whole = model_kv_bytes_per_token(model, kv_dtype_bytes)
        return Figure("kv_bytes_per_token_per_gpu", whole.value, "B",
                      f"MLA latent is replicated on all {tp} ranks: {whole.value:,.0f} B per GPU")
    heads = kv_heads_per_gpu(model.num_kv_heads, tp)
    value = kv_bytes_per_token(model.num_layers, heads, model.head_dim, kv_dtype_bytes)
    how = (f"{model.num_kv_heads} kv_heads / TP {tp} = {heads}" if model.num_kv_heads % tp == 0
           else f"TP {tp} > {model.num_kv_heads} kv_heads: each rank keeps 1 replicated head")
    return Figure("kv_bytes_per_token_per_gpu", value, "B",
                  f"{how}; 2 x {model.num_layers} x {heads} x {model.head_dim} x {kv_dtype_bytes:g} B "
                  f"= {value:,.0f} B per GPU")
