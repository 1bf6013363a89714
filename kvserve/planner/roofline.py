"""Step time from the roofline: each step streams its weights and KV and does its FLOPs.

One engine step on one GPU of a TP-``t`` replica takes::

    t_step = overhead + seqs x per-seq overhead
           + max(weight bytes / (BW x eff_mem),  linear FLOPs / (FLOPS x eff_flops))   # GEMMs
           + max(KV bytes     / (BW x eff_kv),   attention FLOPs / (FLOPS x eff_flops)) # attention
           + all-reduce time (t > 1)
           + the ranks' skew at those all-reduces (t > 1; ``rank_skew.py``)

GEMMs and attention are separate kernels, so their times add; each is bound by
the slower of its memory traffic and its arithmetic. Decode at small batch is
memory-bound (weights dominate); prefill is compute-bound.
"""
from __future__ import annotations

from dataclasses import dataclass

from kvserve.planner.dtypes import KVDType, WeightDType
from kvserve.planner.figures import Figure, fmt_bytes, fmt_rate, fmt_seconds
from kvserve.planner.hardware import HardwareSpec
from kvserve.planner.kv_memory import kv_bytes_per_token_per_gpu
from kvserve.planner.memory import BF16_BYTES
from kvserve.planner.models import ModelSpec, active_params, attention_flops_per_pair, param_counts
from kvserve.planner.moe import all_to_all_s
from kvserve.planner.rank_skew import rank_skew_s


@dataclass(frozen=True)
class CostModel:
    """Per-GPU constants of one replica (model x dtypes x hardware x TP), resolved once."""

    model: ModelSpec
    hw: HardwareSpec
    tp: int
    dense_weight_bytes: float      # per GPU: attention, dense MLPs, shared experts, routers, norms
    lm_head_bytes: float           # per GPU (the embedding matrix when tied)
    expert_bytes: float            # per GPU: one routed expert of one layer
    num_moe_layers: int
    active_body_params: float      # per token, whole model
    lm_params: float
    kv_bytes_per_token: float      # per GPU
    attn_flops_per_pair: float     # whole model (all layers), per (query, key) pair
    flops: float                   # peak FLOP/s for the weight dtype's compute
    compute_dtype: str
    act_bytes: float
    expert_parallel: bool = False  # MoE experts spread over the TP group: all-to-all per MoE layer


def cost_model(model: ModelSpec, hw: HardwareSpec, wdtype: WeightDType, kv: KVDType, tp: int,
               native_bytes_per_param: float | None = None, expert_parallel: bool = False) -> CostModel:
    """Resolve the per-GPU byte and FLOP constants for ``model`` on ``hw`` at TP ``tp``."""
    c = param_counts(model)
    body_b = native_bytes_per_param or wdtype.bytes_per_weight(model.hidden_size)
    table_b = BF16_BYTES if (wdtype.quantized and native_bytes_per_param is None) else body_b
    lm_params = float(c.lm_head or c.embedding)
    flops, compute = hw.flops_for(wdtype.compute)
    act = 4.0 if compute == "fp32" else BF16_BYTES
    return CostModel(
        model=model, hw=hw, tp=tp,
        dense_weight_bytes=(c.body - c.routed_experts) * body_b / tp,
        lm_head_bytes=lm_params * table_b / tp,
        expert_bytes=c.expert_params_each * body_b / tp, num_moe_layers=c.num_moe_layers,
        active_body_params=float(active_params(model, c) - c.embedding - c.lm_head), lm_params=lm_params,
        kv_bytes_per_token=kv_bytes_per_token_per_gpu(model, kv.bytes, tp, kv.scale_bytes).value,
        attn_flops_per_pair=float(model.num_layers * attention_flops_per_pair(model)),
        flops=flops, compute_dtype=compute, act_bytes=act,
        expert_parallel=expert_parallel and model.moe is not None and tp > 1)


@dataclass(frozen=True)
class StepWork:
    """What one step computes: query tokens, sequences sampled, and its attention kernels.

    ``attn`` holds one (KV tokens read, query-key pairs) entry per attention kernel the
    step launches (a decode batch, each prefill chunk); their times add.
    """

    num_tokens: int
    num_seqs: int
    attn: tuple[tuple[float, float], ...] = ()

    @property
    def kv_tokens_read(self) -> float:
        return sum(kv for kv, _ in self.attn)

    @property
    def attn_pairs(self) -> float:
        return sum(p for _, p in self.attn)


def decode_work(batch: int, context: float) -> StepWork:
    """``batch`` sequences each adding one token after ``context`` cached tokens."""
    return StepWork(batch, batch, ((batch * context, batch * context),))


def chunk_attention(start: int, n: int, mode: str = "sum") -> tuple[float, float]:
    """(KV tokens read, pairs) of a prefill chunk of ``n`` tokens after ``start`` cached ones.

    "sum": a causal kernel (n x start + n(n+1)/2 pairs). "padded": the torch reference
    backend, causal for a first chunk but a dense masked kernel (n x (start + n) pairs) for
    a chunk that continues a prompt."""
    ctx = start + n
    pairs = n * ctx if mode == "padded" and start > 0 else n * start + n * (n + 1) / 2
    return float(ctx), float(pairs)


def prefill_work(prompt: int, mode: str = "sum") -> StepWork:
    """One fresh prompt of ``prompt`` tokens in a single step."""
    return StepWork(prompt, 1, (chunk_attention(0, prompt, mode),))


@dataclass(frozen=True)
class StepTime:
    """A step's time and its parts (seconds, per GPU); ``bound`` names the largest part."""

    total_s: float
    weights_s: float
    linear_compute_s: float
    kv_s: float
    attn_compute_s: float
    comm_s: float
    overhead_s: float
    weight_bytes: float
    kv_bytes: float
    linear_flops: float
    attn_flops: float
    skew_s: float = 0.0

    @property
    def bound(self) -> str:
        parts = {"weights (memory)": self.weights_s, "GEMM compute": self.linear_compute_s,
                 "KV reads (memory)": self.kv_s, "attention compute": self.attn_compute_s,
                 "communication": self.comm_s, "rank skew": self.skew_s, "host overhead": self.overhead_s}
        return max(parts, key=parts.get)


def experts_touched(num_experts: int, top_k: int, num_tokens: int) -> float:
    """Expected distinct experts hit in one layer by ``num_tokens`` tokens choosing ``top_k`` each
    (uniform routing): E x (1 - (1 - k/E)^n)."""
    return num_experts * (1.0 - (1.0 - top_k / num_experts) ** num_tokens)


def step_weight_bytes(cm: CostModel, num_tokens: int, samples: bool = True) -> float:
    """Weight bytes one GPU streams in a step of ``num_tokens`` tokens (LM head only if it samples)."""
    total = cm.dense_weight_bytes + (cm.lm_head_bytes if samples else 0.0)
    if cm.model.moe is not None and num_tokens > 0:
        e = cm.model.moe
        total += cm.num_moe_layers * experts_touched(e.num_experts, e.experts_per_token, num_tokens) \
            * cm.expert_bytes
    return total


def allreduce_s(cm: CostModel, num_tokens: int, num_seqs: int = 0) -> float:
    """A step's collectives on the wire: two ring all-reduces of [tokens, hidden] per layer and
    the vocabulary-parallel embedding's one, 2(t-1)/t x bytes / link + latency each, and with
    ``num_seqs`` sampled rows the gather of their fp32 logits, (t-1)/t x rows x vocab x 4 bytes
    / link + latency. With expert parallelism, each MoE layer adds a dispatch + combine all-to-all."""
    if cm.tp == 1:
        return 0.0
    hw = cm.hw
    link = max(hw.interconnect_bw if cm.tp <= hw.gpus_per_node else min(hw.interconnect_bw, 50e9), 1.0)
    size = num_tokens * cm.model.hidden_size * cm.act_bytes
    one = 2 * (cm.tp - 1) / cm.tp * size / link + hw.interconnect_latency_s
    total = (2 * cm.model.num_layers + 1) * one
    if num_seqs:
        total += (cm.tp - 1) / cm.tp * num_seqs * cm.model.vocab_size * 4 / link + hw.interconnect_latency_s
    if cm.expert_parallel:
        total += cm.num_moe_layers * all_to_all_s(cm.model, hw, cm.tp, num_tokens, cm.act_bytes)[1]
    return total


def collectives_per_step(cm: CostModel) -> int:
    """Collectives of one decode step: two all-reduces per layer, the embedding's and the
    logits' gather, and with expert parallelism a dispatch and a combine per MoE layer."""
    return 2 * cm.model.num_layers + 2 + (2 * cm.num_moe_layers if cm.expert_parallel else 0)


def step_time(cm: CostModel, work: StepWork, peak: bool = False) -> StepTime:
    """Time of one step doing ``work``. ``peak`` uses 100% efficiency and no host overhead."""
    hw = cm.hw
    eff_mem, eff_kv, eff_f = (1.0, 1.0, 1.0) if peak else (hw.weight_efficiency(work.num_tokens),
                                                            hw.kv_efficiency, hw.flops_efficiency)
    wbytes = step_weight_bytes(cm, work.num_tokens, work.num_seqs > 0)
    kv_bytes = work.kv_tokens_read * cm.kv_bytes_per_token
    lin_flops = 2 * (cm.active_body_params * work.num_tokens + cm.lm_params * work.num_seqs) / cm.tp
    attn_flops = work.attn_pairs * cm.attn_flops_per_pair / cm.tp
    weights_s = wbytes / (hw.mem_bandwidth * eff_mem)
    lin_s = lin_flops / (cm.flops * eff_f)
    kv_s = kv_bytes / (hw.mem_bandwidth * eff_kv)
    attn_s = attn_flops / (cm.flops * eff_f)
    attn_total = sum(max(kv * cm.kv_bytes_per_token / (hw.mem_bandwidth * eff_kv),
                         pairs * cm.attn_flops_per_pair / cm.tp / (cm.flops * eff_f)) for kv, pairs in work.attn)
    comm = allreduce_s(cm, work.num_tokens, work.num_seqs)
    compute = max(weights_s, lin_s) + attn_total
    skew = 0.0 if peak else rank_skew_s(hw, cm.tp, collectives_per_step(cm), compute)
    overhead = 0.0 if peak else hw.step_overhead_s + hw.seq_overhead_s * work.num_seqs
    total = overhead + compute + comm + skew
    return StepTime(total, weights_s, lin_s, kv_s, attn_s, comm, overhead, wbytes, kv_bytes,
                    lin_flops, attn_flops, skew)


def explain_step(cm: CostModel, work: StepWork, st: StepTime, label: str) -> str:
    """One line: the step's bytes and FLOPs, each over its rate, and the sum."""
    hw = cm.hw
    e_w = hw.weight_efficiency(work.num_tokens)
    skew = f" + rank skew {fmt_seconds(st.skew_s)}" if st.skew_s else ""
    return (f"{label}: max(weights {fmt_bytes(st.weight_bytes)} / ({fmt_rate(hw.mem_bandwidth, 'B/s')} x "
            f"{e_w:.3g}) = {fmt_seconds(st.weights_s)}, GEMM {st.linear_flops:.3g} FLOP / "
            f"({fmt_rate(cm.flops, 'FLOP/s')} {cm.compute_dtype} x {hw.flops_efficiency:.3g}) = "
            f"{fmt_seconds(st.linear_compute_s)}) + max(KV {work.kv_tokens_read:,.0f} tokens x "
            f"{cm.kv_bytes_per_token:,.0f} B = {fmt_bytes(st.kv_bytes)} / (BW x {hw.kv_efficiency:.3g}) = "
            f"{fmt_seconds(st.kv_s)}, attention {st.attn_flops:.3g} FLOP = {fmt_seconds(st.attn_compute_s)})"
            f" + all-reduce {fmt_seconds(st.comm_s)}{skew} + host {fmt_seconds(st.overhead_s)} = "
            f"{fmt_seconds(st.total_s)} [{st.bound}-bound]")


def ridge_batch(cm: CostModel) -> Figure:
    """Decode batch where the GEMMs turn compute-bound at peak rates (weights only, no KV).

    Dense: 2 x P x B / FLOPS = W / BW  =>  B = (FLOPS / BW) x (W / P) / 2.
    MoE: solved numerically, since the weights read grow with B as more experts are hit.
    """
    hw = cm.hw
    ops_per_byte = cm.flops / hw.mem_bandwidth

    def gap(b: float) -> float:
        flops = 2 * (cm.active_body_params * b + cm.lm_params * b) / cm.tp
        return flops / cm.flops - step_weight_bytes(cm, max(1, round(b))) / hw.mem_bandwidth

    lo, hi = 1.0, 2.0
    while gap(hi) < 0 and hi < 1e7:
        lo, hi = hi, hi * 2
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if gap(mid) < 0 else (lo, mid)
    value = hi if gap(1.0) < 0 else 1.0
    per_param = (cm.dense_weight_bytes + cm.lm_head_bytes) * cm.tp / max(
        1.0, cm.active_body_params + cm.lm_params) if cm.model.moe is None else None
    if per_param is not None:
        text = (f"ops:byte = {fmt_rate(cm.flops, 'FLOP/s')} / {fmt_rate(hw.mem_bandwidth, 'B/s')} = "
                f"{ops_per_byte:,.1f}; x {per_param:.3g} B/param / 2 FLOP per param per token "
                f"= batch {value:,.1f}")
    else:
        text = (f"MoE: smallest batch where 2 x active params x B / FLOPS >= bytes of the experts "
                f"B tokens hit / BW (ops:byte {ops_per_byte:,.1f}) = batch {value:,.1f}")
    return Figure("ridge_batch", value, "seqs", text)
