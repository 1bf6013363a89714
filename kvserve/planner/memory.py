"""Weight bytes, runtime reserve, and how a replica's memory splits at each TP degree.

Per GPU at tensor-parallel degree t::

    usable = memory_utilization x memory
    KV pool = usable - weights / t - runtime overhead - activation peak
    KV tokens per replica = KV pool / (KV bytes per token per GPU)      (block-rounded)
    max concurrency = KV tokens per replica // (blocks per sequence x block size)
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from kvserve.planner.dtypes import WeightDType
from kvserve.planner.figures import Figure, fmt_bytes
from kvserve.planner.hardware import HardwareSpec
from kvserve.planner.kv_memory import kv_bytes_per_token_per_gpu, kv_heads_per_gpu
from kvserve.planner.models import ModelSpec, param_counts

BF16_BYTES = 2.0


def weight_bytes(model: ModelSpec, dtype: WeightDType | None) -> Figure:
    """Bytes of all weights. ``dtype`` None = the checkpoint's own bytes (GGUF) or native dtype.

    8/4-bit dtypes keep the embedding and LM head in bf16 and add their scales.
    """
    c = param_counts(model)
    if dtype is None:
        if model.native_weight_bytes:
            return Figure("weight_bytes", float(model.native_weight_bytes), "B",
                          f"sum of the checkpoint's tensor bytes = {model.native_weight_bytes:,} B "
                          f"({fmt_bytes(model.native_weight_bytes)}) for {c.total:,} params")
        from kvserve.planner.dtypes import weight_dtype
        dtype = weight_dtype(model.native_dtype)
    per = dtype.bytes_per_weight(model.hidden_size)
    if not dtype.quantized:
        value = c.total * per
        return Figure("weight_bytes", value, "B",
                      f"{c.total:,} params x {per:g} B ({dtype.name}) = {value:,.0f} B ({fmt_bytes(value)})")
    table = c.embedding + c.lm_head
    value = c.body * per + table * BF16_BYTES
    return Figure("weight_bytes", value, "B",
                  f"{c.body:,} body params x {dtype.describe(model.hidden_size)} + {table:,} embedding/LM-head "
                  f"params x 2 B (bf16) = {value:,.0f} B ({fmt_bytes(value)})")


def activation_bytes(model: ModelSpec, tp: int, max_batched_tokens: int, max_num_seqs: int,
                     act_bytes: float) -> Figure:
    """Peak activation memory of one forward over ``max_batched_tokens`` tokens on one rank.

    tokens x (4 x hidden + 2 x MLP width / tp) x act bytes  (residual, norms, QKV/out, gate+up)
    + max_num_seqs x vocab / tp x 4 B  (fp32 logits of the sampled rows).
    """
    width = model.intermediate_size
    if model.moe is not None:
        e = model.moe
        width = max(width if e.first_dense_layers else 0,
                    e.experts_per_token * e.expert_intermediate_size + e.shared_intermediate_size)
    per_token = 4 * model.hidden_size + 2 * width / tp
    value = max_batched_tokens * per_token * act_bytes + max_num_seqs * model.vocab_size / tp * 4
    return Figure("activation_bytes", value, "B",
                  f"{max_batched_tokens:,} tokens x (4 x {model.hidden_size} + 2 x {width} / {tp}) x "
                  f"{act_bytes:g} B + {max_num_seqs} seqs x {model.vocab_size:,} / {tp} x 4 B = {fmt_bytes(value)}")


def valid_tp_degrees(model: ModelSpec, max_tp: int) -> list[int]:
    """TP degrees that divide the attention heads and split KV heads evenly (or replicate them)."""
    out = []
    for t in range(1, max_tp + 1):
        if model.num_heads % t:
            continue
        if model.mla is None:
            try:
                kv_heads_per_gpu(model.num_kv_heads, t)
            except ValueError:
                continue
        out.append(t)
    return out


@dataclass(frozen=True)
class ReplicaMemory:
    """Memory of one replica at TP ``tp``, per GPU, and what the KV pool holds."""

    tp: int
    usable_per_gpu: float
    weights_per_gpu: float
    reserve_per_gpu: float             # runtime overhead + activation peak
    kv_pool_per_gpu: float
    kv_bytes_per_token_per_gpu: float
    kv_tokens: int                     # per replica
    max_concurrency: int               # sequences of ``context`` tokens
    fits: bool                         # weights + reserve + one full-context sequence
    arithmetic: str


def replica_memory(model: ModelSpec, hw: HardwareSpec, wbytes: float, kv_bytes: float, tp: int,
                   context: int, block_size: int = 16, max_batched_tokens: int = 8192,
                   max_num_seqs: int = 256, act_bytes: float = BF16_BYTES,
                   kv_scale_bytes: float = 0.0) -> ReplicaMemory:
    """How one replica at TP ``tp`` splits each GPU's memory; KV capacity in tokens and sequences.
    ``kv_bytes`` per element, ``kv_scale_bytes`` per (token, kv head) (8-bit KV scales)."""
    usable = hw.memory_utilization * hw.memory_bytes
    weights = wbytes / tp
    act = activation_bytes(model, tp, max_batched_tokens, max_num_seqs, act_bytes).value
    reserve = hw.runtime_overhead_bytes + act
    pool = usable - weights - reserve
    per_token = kv_bytes_per_token_per_gpu(model, kv_bytes, tp, kv_scale_bytes).value
    blocks = max(0, int(pool // (per_token * block_size)))
    tokens = blocks * block_size
    blocks_per_seq = math.ceil(context / block_size)
    conc = blocks // blocks_per_seq
    text = (f"TP {tp}: usable {hw.memory_utilization:g} x {fmt_bytes(hw.memory_bytes)} = {fmt_bytes(usable)}"
            f" - weights {fmt_bytes(weights)} - reserve {fmt_bytes(reserve)} (runtime "
            f"{fmt_bytes(hw.runtime_overhead_bytes)} + activations {fmt_bytes(act)}) = KV pool "
            f"{fmt_bytes(pool)}/GPU; / {per_token:,.0f} B/token/GPU = {tokens:,} tokens "
            f"({blocks:,} blocks of {block_size}); / {blocks_per_seq} blocks per {context:,}-token seq "
            f"= {conc} seqs")
    return ReplicaMemory(tp, usable, weights, reserve, pool, per_token, tokens, conc, conc >= 1, text)
