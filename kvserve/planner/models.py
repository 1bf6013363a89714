"""Model architecture numbers the planner needs, and parameter counts derived from them.

A :class:`ModelSpec` is the handful of integers that decide memory and FLOPs:
layers, widths, heads, KV heads, head dim, vocabulary, and optional MLA (latent
KV cache) and MoE details. Parameter counts are computed from these numbers,
never typed in, so a preset can be checked against its published size.
"""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class MLASpec:
    """Multi-head latent attention (DeepSeek-V2/V3): the cache holds one compressed
    latent of ``kv_lora_rank`` plus a shared RoPE key of ``qk_rope_head_dim`` per token
    per layer, for all heads together."""

    kv_lora_rank: int
    qk_rope_head_dim: int
    qk_nope_head_dim: int
    v_head_dim: int
    q_lora_rank: int | None = None


@dataclass(frozen=True)
class MoESpec:
    """Mixture of experts: ``num_experts`` routed experts of width ``expert_intermediate_size``,
    ``experts_per_token`` chosen per token, plus always-on shared experts of total width
    ``shared_intermediate_size``. The first ``first_dense_layers`` layers use a dense MLP."""

    num_experts: int
    experts_per_token: int
    expert_intermediate_size: int
    shared_intermediate_size: int = 0
    first_dense_layers: int = 0


@dataclass(frozen=True)
class ModelSpec:
    """A decoder-only transformer's shape. ``source`` says where the numbers come from."""

    name: str
    num_layers: int
    hidden_size: int
    intermediate_size: int          # dense MLP width (dense layers of a MoE too)
    vocab_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    tie_word_embeddings: bool = False
    max_context: int = 8192
    qkv_bias: bool = False
    gated_mlp: bool = True           # SwiGLU/GeGLU: 3 matrices; plain MLP: 2
    mla: MLASpec | None = None
    moe: MoESpec | None = None
    native_dtype: str = "bf16"
    native_weight_bytes: int | None = field(default=None, compare=False)   # e.g. from a GGUF file
    source: str = ""

    @property
    def attention_kind(self) -> str:
        """``mla``, ``mha`` (kv heads = heads), ``mqa`` (1 kv head) or ``gqa``."""
        if self.mla is not None:
            return "mla"
        if self.num_kv_heads == self.num_heads:
            return "mha"
        return "mqa" if self.num_kv_heads == 1 else "gqa"


@dataclass(frozen=True)
class ParamCounts:
    """Parameters by role. ``active`` counts what one token touches (top-k experts only)."""

    embedding: int
    lm_head: int                  # 0 when tied to the embedding
    attention: int                # all layers
    dense_mlp: int                # all dense-MLP layers
    routed_experts: int           # all routed experts, all layers
    shared_and_router: int        # shared experts + routers, all MoE layers
    norms: int
    expert_params_each: int       # one routed expert of one layer
    num_moe_layers: int

    @property
    def total(self) -> int:
        return (self.embedding + self.lm_head + self.attention + self.dense_mlp
                + self.routed_experts + self.shared_and_router + self.norms)

    @property
    def body(self) -> int:
        """Everything but the embedding table and the LM head."""
        return self.total - self.embedding - self.lm_head

    @property
    def dense_body(self) -> int:
        """Body parameters every token uses (all but the routed experts)."""
        return self.body - self.routed_experts


def attention_params_per_layer(m: ModelSpec) -> int:
    """Projection weights of one attention block (plus q/k/v biases if any)."""
    h = m.hidden_size
    if m.mla is not None:
        a = m.mla
        qk_dim = a.qk_nope_head_dim + a.qk_rope_head_dim
        if a.q_lora_rank:
            q = h * a.q_lora_rank + a.q_lora_rank + a.q_lora_rank * m.num_heads * qk_dim
        else:
            q = h * m.num_heads * qk_dim
        kv = h * (a.kv_lora_rank + a.qk_rope_head_dim) + a.kv_lora_rank \
            + a.kv_lora_rank * m.num_heads * (a.qk_nope_head_dim + a.v_head_dim)
        return q + kv + m.num_heads * a.v_head_dim * h
    q_dim = m.num_heads * m.head_dim
    kv_dim = m.num_kv_heads * m.head_dim
    bias = (q_dim + 2 * kv_dim) if m.qkv_bias else 0
    return h * q_dim + 2 * h * kv_dim + q_dim * h + bias


def mlp_params(hidden: int, intermediate: int, gated: bool = True) -> int:
    """One MLP: gate+up+down (gated) or up+down."""
    return (3 if gated else 2) * hidden * intermediate


def param_counts(m: ModelSpec) -> ParamCounts:
    """Parameter counts by role, from the architecture numbers alone."""
    h, layers = m.hidden_size, m.num_layers
    embedding = m.vocab_size * h
    lm_head = 0 if m.tie_word_embeddings else m.vocab_size * h
    attention = layers * attention_params_per_layer(m)
    norms = layers * 2 * h + h
    if m.moe is None:
        return ParamCounts(embedding, lm_head, attention, layers * mlp_params(h, m.intermediate_size, m.gated_mlp),
                           0, 0, norms, 0, 0)
    e = m.moe
    moe_layers = layers - e.first_dense_layers
    expert_each = mlp_params(h, e.expert_intermediate_size, m.gated_mlp)
    dense = e.first_dense_layers * mlp_params(h, m.intermediate_size, m.gated_mlp)
    shared = moe_layers * (mlp_params(h, e.shared_intermediate_size, m.gated_mlp) + h * e.num_experts)
    return ParamCounts(embedding, lm_head, attention, dense, moe_layers * e.num_experts * expert_each,
                       shared, norms, expert_each, moe_layers)


def active_params(m: ModelSpec, counts: ParamCounts | None = None) -> int:
    """Parameters one token touches: everything but the routed experts it was not sent to."""
    c = counts or param_counts(m)
    if m.moe is None:
        return c.total
    return c.total - c.routed_experts + c.num_moe_layers * m.moe.experts_per_token * c.expert_params_each


def kv_elements_per_token_per_layer(m: ModelSpec) -> int:
    """Cached elements per token per layer: 2 x kv_heads x head_dim, or the MLA latent + RoPE key."""
    if m.mla is not None:
        return m.mla.kv_lora_rank + m.mla.qk_rope_head_dim
    return 2 * m.num_kv_heads * m.head_dim


def attention_flops_per_pair(m: ModelSpec) -> int:
    """FLOPs for one (query token, cached token) pair in one layer: scores + weighted sum.

    MHA/GQA: 2·H·d (QK) + 2·H·d (AV). MLA in its absorbed decode form attends over the
    latent: 2·H·(r + rope) + 2·H·r.
    """
    if m.mla is not None:
        r = m.mla.kv_lora_rank
        return 2 * m.num_heads * (r + m.mla.qk_rope_head_dim) + 2 * m.num_heads * r
    return 4 * m.num_heads * m.head_dim
