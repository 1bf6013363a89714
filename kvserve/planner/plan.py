"""The planner's entry point: ``make_plan(PlanInputs) -> Plan``, every figure with its arithmetic."""
from __future__ import annotations

import math
from dataclasses import dataclass

from kvserve.planner.candidates import (Candidate, PlanInputs, choose_tp, evaluate_tp, replica_cost_model)
from kvserve.planner.errors import ImpossibleInputError, PlannerInputError
from kvserve.planner.figures import Figure, find_figure, fmt_rate, fmt_seconds
from kvserve.planner.fleet import usd_per_million_tokens, usd_per_month
from kvserve.planner.hardware import validate_hardware
from kvserve.planner.kv_memory import kv_bytes_per_token_per_gpu, model_kv_bytes_per_token
from kvserve.planner.memory import valid_tp_degrees, weight_bytes
from kvserve.planner.moe import moe_figures
from kvserve.planner.models import active_params, param_counts
from kvserve.planner.roofline import StepWork, decode_work, explain_step, ridge_batch, step_time
from kvserve.planner.speculative import speculative


@dataclass(frozen=True)
class Plan:
    """The chosen configuration, every candidate TP looked at, and the figures in report order."""

    inputs: PlanInputs
    chosen: Candidate
    candidates: tuple[Candidate, ...]
    figures: tuple[Figure, ...]
    notes: tuple[str, ...]

    def figure(self, name: str) -> Figure:
        return find_figure(self.figures, name)

    def to_json(self) -> dict:
        """Machine-readable plan: figure values at the top level, their arithmetic alongside."""
        inp = self.inputs
        out: dict = {"model": inp.model.name, "model_source": inp.model.source, "gpu": inp.hw.name,
                     "weight_dtype": inp.weight_dtype.name if inp.weight_dtype else "native",
                     "kv_dtype": inp.kv_dtype.name, "attention": inp.model.attention_kind}
        for f in self.figures:
            out[f.name] = _json_number(f.value)
        out["slo_violations"] = list(self.chosen.slo_violations)
        out["notes"] = list(self.notes)
        shown = [c for c in self.candidates if c.tp <= max(inp.hw.gpus_per_node, self.chosen.tp)]
        out["memory_by_tp"] = [{"tp": c.tp, "fits": c.fits, "kv_tokens_per_replica": c.memory.kv_tokens,
                                "max_concurrency": c.memory.max_concurrency, "replicas": int(c.replicas.value),
                                "gpus": c.gpus, "weights_per_gpu": c.memory.weights_per_gpu,
                                "reserve_per_gpu": c.memory.reserve_per_gpu,
                                "kv_pool_per_gpu": c.memory.kv_pool_per_gpu,
                                "slo_violations": list(c.slo_violations)} for c in shown]
        out["arithmetic"] = {f.name: f.arithmetic for f in self.figures}
        return out


def _json_number(value: float):
    if isinstance(value, float) and math.isinf(value):
        return None
    if float(value).is_integer() and abs(value) < 2**53:
        return int(value)
    return round(float(value), 6)


def _validate(inp: PlanInputs) -> None:
    validate_hardware(inp.hw)
    inp.workload.validate(inp.model.max_context)
    if inp.spec is not None:
        inp.spec.validate()


def make_plan(inp: PlanInputs) -> Plan:
    """Fit, size, time and price the workload; raise ImpossibleInputError when nothing fits."""
    _validate(inp)
    model, o = inp.model, inp.options
    wbytes = weight_bytes(model, inp.weight_dtype)
    ridge = ridge_batch(replica_cost_model(inp, 1))
    degrees = valid_tp_degrees(model, max(o.max_tp, o.tp or 1))
    if o.tp is not None and o.tp not in degrees:
        raise PlannerInputError(f"--tp {o.tp} is not valid for {model.name}: TP must divide the "
                                f"{model.num_heads} attention heads and split the {model.num_kv_heads} KV heads "
                                f"evenly; valid: {degrees}", param="tp")
    cands = [evaluate_tp(inp, t, wbytes.value, ridge.value) for t in ([o.tp] if o.tp else degrees)]
    w = inp.workload
    chosen, reason = choose_tp(cands, inp.hw.gpus_per_node, w.ttft_p99_s is not None or w.tpot_s is not None)
    if chosen is None:
        last = cands[-1].memory
        raise ImpossibleInputError(f"{model.name} does not fit on {inp.hw.name} at any TP up to "
                                   f"{cands[-1].tp}: {last.arithmetic}", param="gpu")
    figures = _memory_figures(inp, chosen, wbytes, reason) + _speed_figures(inp, chosen, ridge)
    figures += _cost_figures(inp, chosen)
    figures += _extra_figures(inp, chosen)
    _check_claim(inp, chosen)
    return Plan(inp, chosen, tuple(cands), tuple(figures), tuple(_notes(inp, chosen)))


def _decode_context(inp: PlanInputs) -> float:
    w = inp.workload
    if w.traffic_mode:
        return w.prompt_tokens().mean + w.output_tokens().mean / 2
    return float(w.context)


def _seq_tokens(inp: PlanInputs) -> int:
    """KV tokens one sequence holds: the context, or mean prompt + mean output in traffic mode."""
    w = inp.workload
    return math.ceil(w.prompt_tokens().mean + w.output_tokens().mean if w.traffic_mode else w.context)


def _memory_figures(inp: PlanInputs, c: Candidate, wbytes: Figure, reason: str) -> list[Figure]:
    model, mem = inp.model, c.memory
    counts = param_counts(model)
    act = active_params(model, counts)
    return [
        Figure("total_params", float(counts.total), "params", f"from the architecture: {counts.total:,}"),
        Figure("active_params", float(act), "params",
               "dense model: all params" if model.moe is None else f"{act:,} touched per token"),
        wbytes,
        model_kv_bytes_per_token(model, inp.kv_dtype.bytes, inp.kv_dtype.scale_bytes),
        kv_bytes_per_token_per_gpu(model, inp.kv_dtype.bytes, c.tp, inp.kv_dtype.scale_bytes),
        Figure("tp", float(c.tp), "GPUs", reason),
        Figure("kv_tokens_per_replica", float(mem.kv_tokens), "tokens", mem.arithmetic),
        Figure("max_concurrency", float(mem.max_concurrency), "seqs",
               f"{mem.kv_tokens:,} tokens / {_seq_tokens(inp):,} tokens per seq (block-rounded) "
               f"= {mem.max_concurrency}"),
    ]


def _speed_figures(inp: PlanInputs, c: Candidate, ridge: Figure) -> list[Figure]:
    ctx = _decode_context(inp)
    bs1 = step_time(c.cm, decode_work(1, ctx))
    peak1 = step_time(c.cm, decode_work(1, ctx), peak=True)
    prompt, w = inp.workload.prompt_tokens(), inp.workload
    return [
        Figure("decode_ms_per_token_bs1", bs1.total_s * 1e3, "ms",
               explain_step(c.cm, decode_work(1, ctx), bs1, f"batch 1 at context {ctx:,.0f}")),
        Figure("decode_bound_ms_per_token_bs1", peak1.total_s * 1e3, "ms",
               f"at 100% of peak bandwidth/FLOP/s, no host overhead (all-reduce included): "
               f"{fmt_seconds(peak1.total_s)}"),
        ridge,
        Figure("prefill_ms", c.prefill_s * 1e3, "ms",
               f"prompt {prompt.mean:,.0f} tokens in chunks of {inp.options.max_batched_tokens:,}, "
               f"compute-bound: {fmt_seconds(c.prefill_s)}"),
        Figure("batch_per_replica", float(c.batch), "seqs",
               "largest batch meeting the TPOT SLO within the KV pool" if w.tpot_s else "sequences per replica"),
        Figure("tpot_ms", c.step_s * 1e3, "ms",
               f"decode step at batch {c.batch}{' / expected tokens per step' if inp.spec else ''} "
               f"= {fmt_seconds(c.step_s)}"),
        Figure("ttft_p99_ms" if w.traffic_mode else "ttft_ms", c.ttft.value * 1e3, "ms", c.ttft.arithmetic),
    ]


def _cost_figures(inp: PlanInputs, c: Candidate) -> list[Figure]:
    w, hw = inp.workload, inp.hw
    replicas = int(c.replicas.value)
    gpus = c.gpus
    per_gpu = c.tokens_per_s_per_replica / c.tp
    figs = [c.replicas,
            Figure("gpus", float(gpus), "GPUs", f"TP {c.tp} x {replicas} replicas = {gpus}"),
            Figure("output_tokens_per_s_per_gpu", per_gpu, "tokens/s",
                   f"{c.tokens_per_s_per_replica:,.1f} output tokens/s per replica / TP {c.tp} = {per_gpu:,.1f}"),
            usd_per_month(gpus, hw.price_per_hour)]
    fleet_usd_h = gpus * hw.price_per_hour
    full = usd_per_million_tokens(fleet_usd_h, c.tokens_per_s_per_replica * replicas,
                                  "usd_per_million_output_tokens_at_capacity")
    if w.traffic_mode:
        served = w.rps * w.output_tokens().mean
        figs.append(usd_per_million_tokens(fleet_usd_h, served, what="output tokens/s served at mean traffic"))
        figs.append(full)
    else:
        figs.append(Figure("usd_per_million_output_tokens", full.value, "$", full.arithmetic))
    return figs


def _extra_figures(inp: PlanInputs, c: Candidate) -> list[Figure]:
    figs: list[Figure] = []
    if inp.spec is not None:
        cap = max(c.batch, min(c.memory.max_concurrency, inp.options.max_num_seqs))
        s = speculative(c.cm, inp.spec, c.batch, _decode_context(inp), max_batch=cap)
        figs += [s.expected_tokens, s.speedup, s.breakeven_batch]
    moe = None
    if inp.model.moe is not None:
        ep = c.tp if inp.model.moe.num_experts % c.tp == 0 else 1
        moe = moe_figures(inp.model, inp.hw, ep, c.batch, included=c.cm.expert_parallel)
    if moe is not None:
        figs += [_ep_figure(inp, c, ep), moe.experts_per_gpu, moe.all_to_all_per_layer, moe.all_to_all_per_step]
    return figs


def _ep_figure(inp: PlanInputs, c: Candidate, ep: int) -> Figure:
    """The expert-parallel degree the MoE figures use, and whether the step times include it."""
    experts = inp.model.moe.num_experts
    if ep == 1:
        why = (f"TP 1: one GPU holds all {experts} experts" if c.tp == 1
               else f"{experts} experts do not split over TP {c.tp}: experts TP-sharded, EP 1")
    elif c.cm.expert_parallel:
        why = (f"--expert-parallel: {experts} experts spread over the TP group of {ep} GPUs; the all-to-all "
               f"is in the step time")
    else:
        why = (f"EP = the TP group of {ep} GPUs, shown for comparison; the step times shard experts by TP "
               f"(--expert-parallel to spread them)")
    return Figure("ep", float(ep), "GPUs", why)


def decode_throughput_bound(inp: PlanInputs, c: Candidate) -> Figure:
    """Most output tokens/s per GPU any engine can reach here: batch = KV-limited max, 100% of peaks."""
    b = max(1, min(c.memory.max_concurrency, inp.options.max_num_seqs))
    ctx = _decode_context(inp)
    t = step_time(c.cm, decode_work(b, ctx), peak=True).total_s
    factor, how = 1.0, ""
    if inp.spec is not None:
        k = inp.spec.k
        t = step_time(c.cm, StepWork(b * (k + 1), b, ((b * ctx, b * (k + 1) * ctx),)), peak=True).total_s
        factor, how = float(k + 1), f" x {k + 1} tokens per verify step"
    value = factor * b / t / c.tp
    return Figure("roofline_tokens_per_s_per_gpu", value, "tokens/s",
                  f"batch {b}{how} / peak step {fmt_seconds(t)} / TP {c.tp} = {value:,.1f} "
                  f"(bandwidth {fmt_rate(inp.hw.mem_bandwidth, 'B/s')})")


def _check_claim(inp: PlanInputs, c: Candidate) -> None:
    claim = inp.options.claimed_tokens_per_s_per_gpu
    if claim is None:
        return
    bound = decode_throughput_bound(inp, c)
    if claim > bound.value:
        raise ImpossibleInputError(
            f"claimed {claim:,.0f} output tokens/s per GPU is above the roofline for {inp.model.name} on "
            f"{inp.hw.name}: at most {bound.value:,.0f} ({bound.arithmetic})", param="claimed_tokens_per_s")


def _notes(inp: PlanInputs, c: Candidate) -> list[str]:
    notes = []
    if c.tp > inp.hw.gpus_per_node:
        notes.append(f"TP {c.tp} spans {math.ceil(c.tp / inp.hw.gpus_per_node)} nodes; in practice use TP "
                     f"{inp.hw.gpus_per_node} x pipeline parallel {math.ceil(c.tp / inp.hw.gpus_per_node)}")
    if inp.model.mla is not None and c.tp > 1:
        notes.append("MLA: the latent KV cache is replicated on every TP rank (it does not shrink with TP); "
                     "data-parallel attention avoids the copies")
    if inp.model.num_kv_heads < c.tp and inp.model.mla is None:
        notes.append(f"TP {c.tp} > {inp.model.num_kv_heads} KV heads: KV heads are replicated")
    if c.slo_violations:
        notes.append("SLO not met: " + "; ".join(c.slo_violations))
    return notes
