"""Evaluate one tensor-parallel degree for a workload: memory, step times, replicas, SLOs."""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from kvserve.planner.dtypes import KVDType, WeightDType, weight_dtype
from kvserve.planner.fleet import replicas_for_concurrency, replicas_for_traffic, request_service_s, ttft_p99
from kvserve.planner.figures import Figure
from kvserve.planner.hardware import HardwareSpec
from kvserve.planner.memory import ReplicaMemory, replica_memory
from kvserve.planner.models import ModelSpec, param_counts
from kvserve.planner.roofline import CostModel, StepWork, chunk_attention, cost_model, decode_work, step_time
from kvserve.planner.speculative import expected_tokens_per_step, spec_step_s
from kvserve.planner.workload import SpecConfig, Workload


@dataclass(frozen=True)
class PlanOptions:
    """Engine limits and planner switches (vLLM-like defaults)."""

    block_size: int = 16
    max_num_seqs: int = 256
    max_batched_tokens: int = 8192
    max_tp: int = 64
    tp: int | None = None                  # force a TP degree
    expert_parallel: bool = False
    claimed_tokens_per_s_per_gpu: float | None = None


@dataclass(frozen=True)
class PlanInputs:
    model: ModelSpec
    hw: HardwareSpec
    weight_dtype: WeightDType | None       # None = the checkpoint's native bytes
    kv_dtype: KVDType
    workload: Workload
    spec: SpecConfig | None = None
    options: PlanOptions = field(default_factory=PlanOptions)


@dataclass(frozen=True)
class Candidate:
    """One TP degree, evaluated. ``batch`` is the sequences per replica the plan runs at."""

    tp: int
    memory: ReplicaMemory
    cm: CostModel
    batch: int
    step_s: float                  # decode step at ``batch`` (speculation included)
    prefill_s: float               # mean prompt
    ttft: Figure
    replicas: Figure
    tokens_per_s_per_replica: float
    slo_violations: tuple[str, ...]
    useful_seqs: int               # sequences a replica must hold to be "useful"

    @property
    def fits(self) -> bool:
        return self.memory.fits

    @property
    def useful(self) -> bool:
        return self.memory.max_concurrency >= self.useful_seqs

    @property
    def gpus(self) -> int:
        return self.tp * int(self.replicas.value)


def replica_cost_model(inp: PlanInputs, tp: int) -> CostModel:
    """The cost model at TP ``tp``; native checkpoint bytes (GGUF) when no weight dtype is given."""
    model = inp.model
    ep = inp.options.expert_parallel
    if inp.weight_dtype is not None:
        return cost_model(model, inp.hw, inp.weight_dtype, inp.kv_dtype, tp, expert_parallel=ep)
    native = model.native_weight_bytes / param_counts(model).total if model.native_weight_bytes else None
    wd = weight_dtype(model.native_dtype if model.native_dtype != "gguf" else "bf16")
    return cost_model(model, inp.hw, wd, inp.kv_dtype, tp, native, expert_parallel=ep)


def decode_step_s(cm: CostModel, spec: SpecConfig | None, batch: int, context: float) -> float:
    """Seconds per output token per sequence at ``batch`` (speculative steps divided by E)."""
    if spec is None:
        return step_time(cm, decode_work(batch, context)).total_s
    _plain, spec_s = spec_step_s(cm, spec, batch, context)
    return spec_s / expected_tokens_per_step(spec.alpha, spec.k).value


def prefill_s(cm: CostModel, prompt: float, chunk: int) -> float:
    """Prompt processing time, in chunks of at most ``chunk`` tokens (plus per-request host time)."""
    mode = cm.hw.kv_read_mode
    total, done, remaining = 0.0, 0, int(math.ceil(prompt))
    while remaining > 0:
        n = min(chunk, remaining)
        work = StepWork(n, 1 if n == remaining else 0, (chunk_attention(done, n, mode),))
        total += step_time(cm, work).total_s
        done, remaining = done + n, remaining - n
    return total + cm.hw.request_overhead_s


def max_batch_within(cm: CostModel, spec, limit: int, context: float, tpot_s: float | None) -> int:
    """Largest batch <= ``limit`` whose per-token decode time meets ``tpot_s`` (1 if none does)."""
    if tpot_s is None or limit <= 1:
        return max(1, limit)
    if decode_step_s(cm, spec, limit, context) <= tpot_s:
        return limit
    lo, hi = 1, limit
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if decode_step_s(cm, spec, mid, context) <= tpot_s else (lo, mid)
    return lo


def evaluate_tp(inp: PlanInputs, tp: int, wbytes: float, ridge: float) -> Candidate:
    """Memory split, operating batch, step times, replicas and SLO check for TP ``tp``."""
    w, o = inp.workload, inp.options
    out, prompt = w.output_tokens(), w.prompt_tokens()
    seq_tokens = w.context if not w.traffic_mode else prompt.mean + out.mean
    cm = replica_cost_model(inp, tp)
    mem = replica_memory(inp.model, inp.hw, wbytes, inp.kv_dtype.bytes, tp, int(math.ceil(seq_tokens)),
                         o.block_size, o.max_batched_tokens, o.max_num_seqs, cm.act_bytes,
                         inp.kv_dtype.scale_bytes)
    limit = max(1, min(mem.max_concurrency, o.max_num_seqs))
    pre = prefill_s(cm, prompt.mean, o.max_batched_tokens)
    if not w.traffic_mode:
        return _context_candidate(inp, tp, mem, cm, pre, ridge)
    kv_ctx = prompt.mean + out.mean / 2
    batch = max_batch_within(cm, inp.spec, limit, kv_ctx, w.tpot_s)
    step = decode_step_s(cm, inp.spec, batch, kv_ctx)
    service = request_service_s(pre, out.mean, step, batch)
    replicas = replicas_for_traffic(w.rps, w.peak_to_mean, service.value, w.headroom)
    rate = w.rps * w.peak_to_mean / replicas.value
    ttft = ttft_p99(step, prefill_s(cm, prompt.p99, o.max_batched_tokens), pre, rate)
    little = math.ceil(w.rps * w.peak_to_mean * out.mean * decode_step_s(cm, inp.spec, 1, kv_ctx))
    return Candidate(tp, mem, cm, batch, step, pre, ttft, replicas, out.mean / service.value,
                     _violations(w, ttft.value, step), min(math.ceil(ridge), max(1, little)))


def _context_candidate(inp: PlanInputs, tp: int, mem: ReplicaMemory, cm: CostModel, pre: float,
                       ridge: float) -> Candidate:
    w = inp.workload
    replicas = replicas_for_concurrency(w.concurrency, max(1, mem.max_concurrency))
    batch = max(1, math.ceil(w.concurrency / replicas.value))
    step = decode_step_s(cm, inp.spec, batch, w.context)
    ttft = Figure("ttft_s", pre + step, "s", f"prefill {pre * 1e3:.1f} ms + one decode step {step * 1e3:.1f} ms "
                  f"= {(pre + step) * 1e3:.1f} ms (no queueing)")
    return Candidate(tp, mem, cm, batch, step, pre, ttft, replicas, batch / step,
                     _violations(w, ttft.value, step), min(math.ceil(ridge), w.concurrency))


def _violations(w: Workload, ttft_s: float, step_s: float) -> tuple[str, ...]:
    out = []
    if w.ttft_p99_s is not None and ttft_s > w.ttft_p99_s:
        out.append(f"TTFT p99 {ttft_s * 1e3:.0f} ms > {w.ttft_p99_s * 1e3:.0f} ms")
    if w.tpot_s is not None and step_s > w.tpot_s:
        out.append(f"TPOT {step_s * 1e3:.1f} ms > {w.tpot_s * 1e3:.1f} ms")
    return tuple(out)


def choose_tp(cands: list[Candidate], gpus_per_node: int, has_slo: bool = False) -> tuple[Candidate | None, str]:
    """The smallest TP whose KV pool is useful (within a node); else the largest that fits in a
    node; else the smallest that fits across nodes. Candidates meeting the SLOs go first."""
    fitting = [c for c in cands if c.fits]
    if not fitting:
        return None, "no TP degree fits the weights, the reserve and one sequence"
    meeting = [c for c in fitting if not c.slo_violations]
    pool, slo_note = (meeting, "") if meeting else (fitting, "; no TP meets the SLOs (chosen by memory alone)")
    in_node = [c for c in pool if c.tp <= gpus_per_node]
    useful = [c for c in in_node if c.useful]
    if useful:
        c = useful[0]
        return c, (f"smallest TP whose KV pool holds {c.useful_seqs} seqs (min of concurrency and ridge "
                   f"batch){' and meets the SLOs' if meeting and has_slo else ''}{slo_note}")
    if in_node:
        return in_node[-1], f"no TP in a {gpus_per_node}-GPU node holds the useful pool: largest that fits{slo_note}"
    return pool[0], f"weights need more than one {gpus_per_node}-GPU node: smallest TP that fits{slo_note}"
