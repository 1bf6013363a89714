"""The disaggregated layout (``kvserve plan --disaggregate``): prefill instances sized from prefill
demand at the TTFT SLO, decode instances from decode demand at the TPOT SLO, the KV moved between
them, the threshold rule's break-even, and the comparison with the unified plan.

Every number comes from the functions the unified plan uses (``prefill_s``, ``max_batch_within``,
``decode_step_s`` and ``replica_memory`` per instance TP, ``fleet.ttft_p99`` for the queueing, the KV
formula of ``kv_memory.py`` for the bytes), so the two plans differ only in the layout.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from kvserve.planner.candidates import (PlanInputs, decode_step_s, max_batch_within, prefill_s,
                                        replica_cost_model)
from kvserve.planner.disagg_kv import (breakeven_prompt_tokens, chunk_added_s, chunk_budget, kv_import_s, kv_link,
                                       kv_transfer_bytes, kv_transfer_s, stall_s, transfer_seconds,
                                       tpot_break_prompt_tokens)
from kvserve.planner.errors import ImpossibleInputError, PlannerInputError
from kvserve.planner.figures import Figure, find_figure, fmt_seconds
from kvserve.planner.fleet import request_service_s, ttft_p99, usd_per_million_tokens, usd_per_month
from kvserve.planner.memory import ReplicaMemory, replica_memory, valid_tp_degrees, weight_bytes
from kvserve.planner.plan import Plan, _json_number, make_plan
from kvserve.planner.roofline import CostModel


@dataclass(frozen=True)
class DisaggOptions:
    """Switches of the disaggregated layout: ``link_bw`` (bytes/s) replaces the interconnect."""

    link_bw: float | None = None


@dataclass(frozen=True)
class DecodeInstance:
    """One decode-instance TP degree, evaluated."""

    tp: int
    memory: ReplicaMemory
    cm: CostModel
    batch: int
    step_s: float
    import_mean: Figure
    import_p99: Figure
    capacity: Figure            # output tokens/s one instance serves (imports included)
    instances: Figure
    violations: tuple[str, ...]

    @property
    def gpus(self) -> int:
        return self.tp * int(self.instances.value)


@dataclass(frozen=True)
class PrefillInstance:
    """One prefill-instance TP degree, evaluated against a chosen decode instance."""

    tp: int
    memory: ReplicaMemory
    prefill_mean_s: float
    prefill_p99_s: float
    transfer_bytes: Figure
    transfer: Figure
    transfer_p99: Figure
    link_bw: float
    utilisation: Figure         # the prefill load one instance may carry at the TTFT SLO
    capacity: Figure            # prompt tokens/s at that load
    instances: Figure
    ttft: Figure
    violations: tuple[str, ...]

    @property
    def gpus(self) -> int:
        return self.tp * int(self.instances.value)


@dataclass(frozen=True)
class DisaggPlan:
    """The unified plan, the chosen prefill and decode instances, and the figures in report order."""

    unified: Plan
    prefill: PrefillInstance
    decode: DecodeInstance
    prefill_options: tuple[PrefillInstance, ...]
    decode_options: tuple[DecodeInstance, ...]
    figures: tuple[Figure, ...]
    notes: tuple[str, ...]

    def figure(self, name: str) -> Figure:
        return find_figure(self.figures, name)

    def to_json(self) -> dict:
        """The unified plan's JSON with a ``disaggregation`` object (figures, arithmetic, per-TP rows)."""
        out = self.unified.to_json()
        d: dict = {f.name: _json_number(f.value) for f in self.figures}
        d["slo_violations"] = list(self.prefill.violations + self.decode.violations)
        d["notes"] = list(self.notes)
        widest = max(self.unified.inputs.hw.gpus_per_node, self.prefill.tp, self.decode.tp)
        d["prefill_by_tp"] = [{"tp": p.tp, "fits": p.memory.fits, "instances": int(p.instances.value),
                               "gpus": p.gpus, "ttft_p99_ms": round(p.ttft.value, 3),
                               "slo_violations": list(p.violations)} for p in self.prefill_options
                              if p.tp <= widest]
        d["decode_by_tp"] = [{"tp": c.tp, "fits": c.memory.fits, "batch": c.batch,
                              "tpot_ms": round(c.step_s * 1e3, 3), "instances": int(c.instances.value),
                              "gpus": c.gpus, "slo_violations": list(c.violations)} for c in self.decode_options
                             if c.tp <= widest]
        d["arithmetic"] = {f.name: f.arithmetic for f in self.figures}
        out["disaggregation"] = d
        return out


def _memory(inp: PlanInputs, tp: int, cm: CostModel, seq_tokens: float) -> ReplicaMemory:
    o = inp.options
    return replica_memory(inp.model, inp.hw, weight_bytes(inp.model, inp.weight_dtype).value, inp.kv_dtype.bytes,
                          tp, int(math.ceil(seq_tokens)), o.block_size, o.max_batched_tokens, o.max_num_seqs,
                          cm.act_bytes, inp.kv_dtype.scale_bytes)


def evaluate_decode(inp: PlanInputs, tp: int) -> DecodeInstance:
    """A decode instance at TP ``tp``: the largest batch meeting the TPOT SLO in its KV pool, its
    step, the imports it absorbs, and instances = ceil(decode demand / capacity x (1 - headroom))."""
    w, o = inp.workload, inp.options
    prompt, out = w.prompt_tokens(), w.output_tokens()
    cm = replica_cost_model(inp, tp)
    mem = _memory(inp, tp, cm, prompt.mean + out.mean)
    kv_ctx = prompt.mean + out.mean / 2
    batch = max_batch_within(cm, inp.spec, max(1, min(mem.max_concurrency, o.max_num_seqs)), kv_ctx, w.tpot_s)
    step = decode_step_s(cm, inp.spec, batch, kv_ctx)
    imp = kv_import_s(inp.model, inp.kv_dtype, inp.hw, tp, prompt.mean, o.block_size)
    imp99 = kv_import_s(inp.model, inp.kv_dtype, inp.hw, tp, prompt.p99, o.block_size, "kv_import_ms_p99")
    service = request_service_s(imp.value / 1e3, out.mean, step, batch).value
    cap = out.mean / service
    capacity = Figure("decode_capacity_tokens_per_s", cap, "tokens/s",
                      f"{out.mean:g} output tokens / (import {fmt_seconds(imp.value / 1e3)} + {out.mean:g} x step "
                      f"{fmt_seconds(step)} / batch {batch}) = {cap:,.1f} per instance at TP {tp}")
    demand = w.rps * w.peak_to_mean * out.mean
    n = max(1, math.ceil(demand / (cap * (1 - w.headroom))))
    instances = Figure("decode_instances", float(n), "instances",
                       f"ceil(decode demand {w.rps * w.peak_to_mean:,.4g} req/s x {out.mean:g} = {demand:,.1f} "
                       f"tokens/s / ({cap:,.1f} x (1 - {w.headroom:g} headroom))) = {n}")
    bad = (f"TPOT {step * 1e3:.1f} ms > {w.tpot_s * 1e3:.1f} ms",) if w.tpot_s and step > w.tpot_s else ()
    return DecodeInstance(tp, mem, cm, batch, step, imp, imp99, capacity, instances, bad)


def _prefill_load(inp: PlanInputs, pre99: float, fixed_s: float) -> tuple[float, str, bool]:
    """(utilisation, why, SLO reachable): the prefill load rho with fixed + p99 / (1 - rho) = TTFT SLO
    (``fleet.ttft_p99``'s queueing), capped at 1 - headroom and at ttft_p99's 0.95."""
    w = inp.workload
    cap = min(0.95, 1 - w.headroom)
    if w.ttft_p99_s is None:
        return cap, f"no TTFT SLO: 1 - {w.headroom:g} headroom = {cap:.3g}", True
    budget = w.ttft_p99_s - fixed_s
    if budget <= pre99:
        why = (f"TTFT SLO {fmt_seconds(w.ttft_p99_s)} - {fmt_seconds(fixed_s)} leaves {fmt_seconds(budget)} "
               f"<= p99 prefill {fmt_seconds(pre99)}: unreachable, sized at {cap:.3g}")
        return cap, why, False
    rho = 1 - pre99 / budget
    return min(rho, cap), (f"1 - p99 prefill {fmt_seconds(pre99)} / (TTFT SLO {fmt_seconds(w.ttft_p99_s)} - "
                           f"decode step, transfer, import {fmt_seconds(fixed_s)}) = {rho:.3g}; capped at "
                           f"{cap:.3g} (headroom) = {min(rho, cap):.3g}"), True


def evaluate_prefill(inp: PlanInputs, tp: int, decode: DecodeInstance, dopt: DisaggOptions) -> PrefillInstance:
    """A prefill instance at TP ``tp`` feeding ``decode``: capacity in prompt tokens/s at the load the
    TTFT SLO allows, instances = ceil(prefill demand / capacity), and the TTFT p99 that results."""
    w, o, hw = inp.workload, inp.options, inp.hw
    prompt = w.prompt_tokens()
    cm = replica_cost_model(inp, tp)
    mem = _memory(inp, tp, cm, prompt.p99)
    pre, pre99 = prefill_s(cm, prompt.mean, o.max_batched_tokens), prefill_s(cm, prompt.p99, o.max_batched_tokens)
    link_bw, why = kv_link(hw, tp, decode.tp, dopt.link_bw)
    links = min(tp, decode.tp)
    tb = kv_transfer_bytes(inp.model, inp.kv_dtype, prompt.mean, o.block_size)
    tr = kv_transfer_s(tb.value, links, link_bw, hw.interconnect_latency_s, why)
    tb99 = kv_transfer_bytes(inp.model, inp.kv_dtype, prompt.p99, o.block_size).value
    tr99 = kv_transfer_s(tb99, links, link_bw, hw.interconnect_latency_s, why, "kv_transfer_ms_p99")
    fixed = decode.step_s + (tr99.value + decode.import_p99.value) / 1e3
    rho, rho_why, reachable = _prefill_load(inp, pre99, fixed)
    util = Figure("prefill_utilisation", rho, "rho", rho_why)
    cap = rho * prompt.mean / pre
    capacity = Figure("prefill_capacity_tokens_per_s", cap, "tokens/s",
                      f"load {rho:.3g} x {prompt.mean:,.0f} prompt tokens / prefill {fmt_seconds(pre)} = "
                      f"{cap:,.0f} per instance at TP {tp}")
    peak = w.rps * w.peak_to_mean
    demand = peak * prompt.mean
    n = max(1, math.ceil(demand / cap))
    instances = Figure("prefill_instances", float(n), "instances",
                       f"ceil(prefill demand {peak:,.4g} req/s x {prompt.mean:,.0f} = {demand:,.0f} tokens/s / "
                       f"{cap:,.0f}) = {n}")
    q = ttft_p99(decode.step_s, pre99, pre, peak / n)
    value = q.value + (tr99.value + decode.import_p99.value) / 1e3
    ttft = Figure("disagg_ttft_p99_ms", value * 1e3, "ms",
                  f"{q.arithmetic} (decode step on the decode instance; prefill queue at {peak / n:,.3g} req/s per "
                  f"prefill instance) + p99 transfer {tr99.value:.3g} ms + import {decode.import_p99.value:.3g} ms "
                  f"= {fmt_seconds(value)}")
    bad = () if reachable and (w.ttft_p99_s is None or value <= w.ttft_p99_s * (1 + 1e-9)) else (
        f"TTFT p99 {value * 1e3:.0f} ms > {w.ttft_p99_s * 1e3:.0f} ms",)
    return PrefillInstance(tp, mem, pre, pre99, tb, tr, tr99, link_bw, util, capacity, instances, ttft, bad)


def _choose(options: list, gpus_per_node: int, closeness) -> tuple[object, str]:
    """Fewest GPUs (then smallest TP) among fitting, in-node degrees meeting the SLO; if none meets it,
    the one ``closeness`` ranks closest."""
    fitting = [c for c in options if c.memory.fits]
    if not fitting:
        return None, ""
    in_node = [c for c in fitting if c.tp <= gpus_per_node] or fitting
    meeting = [c for c in in_node if not c.violations]
    if meeting:
        best = min(meeting, key=lambda c: (c.gpus, c.tp))
        return best, f"fewest GPUs meeting the SLO: TP {best.tp} x {int(best.instances.value)} = {best.gpus}"
    best = min(in_node, key=closeness)
    return best, f"no TP meets the SLO: closest is TP {best.tp} ({best.violations[0]})"


def _inputs_check(inp: PlanInputs, dopt: DisaggOptions) -> None:
    if dopt.link_bw is not None and not dopt.link_bw > 0:
        raise PlannerInputError("--kv-link-gbs must be positive", param="kv_link_gbs")
    if not inp.workload.traffic_mode:
        raise PlannerInputError("--disaggregate needs traffic mode: give --rps, --prompt-tokens and "
                                "--output-tokens", param="disaggregate")


def make_disagg_plan(inp: PlanInputs, dopt: DisaggOptions = DisaggOptions()) -> DisaggPlan:
    """The unified plan, then the disaggregated layout for the same inputs and their comparison."""
    _inputs_check(inp, dopt)
    unified = make_plan(inp)
    o = inp.options
    degrees = [o.tp] if o.tp else valid_tp_degrees(inp.model, o.max_tp)
    decodes = [evaluate_decode(inp, t) for t in degrees]
    decode, d_why = _choose(decodes, inp.hw.gpus_per_node, lambda c: (c.step_s, c.tp))
    if decode is None:
        raise ImpossibleInputError(f"{inp.model.name}: no decode instance fits on {inp.hw.name}", param="gpu")
    prefills = [evaluate_prefill(inp, t, decode, dopt) for t in degrees]
    prefill, p_why = _choose(prefills, inp.hw.gpus_per_node, lambda p: (p.ttft.value, p.tp))
    if prefill is None:
        raise ImpossibleInputError(f"{inp.model.name}: no prefill instance fits on {inp.hw.name}", param="gpu")
    figures = _layout_figures(prefill, decode, p_why, d_why)
    figures += _threshold_figures(inp, unified, prefill, decode)
    figures += _comparison_figures(inp, unified, prefill, decode)
    return DisaggPlan(unified, prefill, decode, tuple(prefills), tuple(decodes), tuple(figures),
                      tuple(_notes(inp, prefill, decode)))


def _layout_figures(p: PrefillInstance, d: DecodeInstance, p_why: str, d_why: str) -> list[Figure]:
    return [
        Figure("prefill_tp", float(p.tp), "GPUs", p_why),
        Figure("prefill_mean_ms", p.prefill_mean_s * 1e3, "ms",
               f"prefill_s(mean prompt) at TP {p.tp} = {fmt_seconds(p.prefill_mean_s)}; p99 prompt = "
               f"{fmt_seconds(p.prefill_p99_s)}"),
        p.utilisation, p.capacity, p.instances, p.ttft,
        Figure("decode_tp", float(d.tp), "GPUs", d_why),
        Figure("decode_batch_per_instance", float(d.batch), "seqs",
               f"largest batch <= min(KV pool {d.memory.max_concurrency} seqs, max_num_seqs) meeting the TPOT "
               f"SLO = {d.batch}"),
        Figure("decode_tpot_ms", d.step_s * 1e3, "ms", f"decode step at batch {d.batch} = {fmt_seconds(d.step_s)}"),
        d.capacity, d.instances,
        p.transfer_bytes, p.transfer, p.transfer_p99, d.import_mean,
    ]


def _threshold_figures(inp: PlanInputs, unified: Plan, p: PrefillInstance, d: DecodeInstance) -> list[Figure]:
    """Where the stall a prompt puts on the unified replica's b streams equals its transfer time, and
    the prompt whose first chunk breaks the TPOT SLO."""
    c, o, w = unified.chosen, inp.options, inp.workload
    ctx = w.prompt_tokens().mean + w.output_tokens().mean / 2
    links, lat = min(p.tp, d.tp), inp.hw.interconnect_latency_s

    def stall(n: int) -> float:
        return stall_s(c.cm, c.batch, ctx, n, o.max_batched_tokens)

    def transfer(n: int) -> float:
        return transfer_seconds(inp.model, inp.kv_dtype, n, o.block_size, links, p.link_bw, lat)

    n = breakeven_prompt_tokens(stall, transfer, o.block_size, inp.model.max_context)
    if n is None:
        text = (f"stall never reaches the transfer up to {inp.model.max_context:,} tokens "
                f"(b {c.batch} streams at TP {c.tp})")
    else:
        text = (f"smallest prompt (from one block) where b {c.batch} streams x the time its chunks add to their "
                f"steps >= its transfer: at {n:,} tokens stall {fmt_seconds(stall(n))} >= transfer "
                f"{fmt_seconds(transfer(n))}" + (f" (at {n - 1:,}: {fmt_seconds(stall(n - 1))} < "
                                                  f"{fmt_seconds(transfer(n - 1))})" if n > o.block_size else ""))
    figs = [Figure("disagg_breakeven_prompt_tokens", float("inf") if n is None else float(n), "tokens", text)]
    if w.tpot_s is not None:
        t = tpot_break_prompt_tokens(c.cm, c.batch, ctx, c.step_s, w.tpot_s, o.max_batched_tokens)
        how = (f"smallest prompt whose first chunk (<= {chunk_budget(o.max_batched_tokens, c.batch):,} tokens) lifts "
               f"the unified step at batch {c.batch} ({fmt_seconds(c.step_s)}) past the TPOT SLO "
               f"{fmt_seconds(w.tpot_s)}")
        if t is not None:
            how += f": {t:,} tokens (step {fmt_seconds(c.step_s + chunk_added_s(c.cm, c.batch, ctx, 0, t))})"
        else:
            how += ": none (a full chunk stays within it, or the plain step already misses it)"
        figs.append(Figure("unified_tpot_break_prompt_tokens", float("inf") if t is None else float(t),
                           "tokens", how))
    return figs


def _comparison_figures(inp: PlanInputs, unified: Plan, p: PrefillInstance, d: DecodeInstance) -> list[Figure]:
    """GPUs, dollars and the TPOT p99 of running streams during prefill bursts, both layouts."""
    c, o, w, hw = unified.chosen, inp.options, inp.workload, inp.hw
    ctx = w.prompt_tokens().mean + w.output_tokens().mean / 2
    gpus = p.gpus + d.gpus
    cost = usd_per_month(gpus, hw.price_per_hour)
    served = w.rps * w.output_tokens().mean
    n = min(int(math.ceil(w.prompt_tokens().p99)), chunk_budget(o.max_batched_tokens, c.batch))
    added = chunk_added_s(c.cm, c.batch, ctx, 0, n)
    u_burst = c.step_s + added
    d_burst = d.step_s + d.import_p99.value / 1e3
    return [
        Figure("unified_gpus", unified.figure("gpus").value, "GPUs", unified.figure("gpus").arithmetic),
        Figure("unified_usd_per_month", unified.figure("usd_per_month").value, "$",
               unified.figure("usd_per_month").arithmetic),
        Figure("disagg_gpus", float(gpus), "GPUs", f"prefill TP {p.tp} x {int(p.instances.value)} + decode TP "
               f"{d.tp} x {int(d.instances.value)} = {gpus}"),
        Figure("disagg_usd_per_month", cost.value, "$", cost.arithmetic),
        usd_per_million_tokens(gpus * hw.price_per_hour, served, "disagg_usd_per_million_output_tokens",
                               "output tokens/s served at mean traffic"),
        Figure("unified_tpot_p99_burst_ms", u_burst * 1e3, "ms",
               f"step at batch {c.batch} {fmt_seconds(c.step_s)} + a {n:,}-token prefill chunk "
               f"(min(p99 prompt, {o.max_batched_tokens:,} - {c.batch} decodes)) {fmt_seconds(added)} = "
               f"{fmt_seconds(u_burst)}"),
        Figure("disagg_tpot_p99_burst_ms", d_burst * 1e3, "ms",
               f"decode step at batch {d.batch} {fmt_seconds(d.step_s)} + import of a p99 prompt "
               f"{fmt_seconds(d.import_p99.value / 1e3)} = {fmt_seconds(d_burst)}"),
        Figure("tpot_p99_burst_ratio", d_burst / u_burst, "x",
               f"disaggregated {fmt_seconds(d_burst)} / unified {fmt_seconds(u_burst)} = {d_burst / u_burst:.3g}"),
    ]


def _notes(inp: PlanInputs, p: PrefillInstance, d: DecodeInstance) -> list[str]:
    notes = []
    for v in p.violations:
        notes.append(f"prefill SLO not met: {v}")
    for v in d.violations:
        notes.append(f"decode SLO not met: {v}")
    if inp.model.moe is not None and inp.options.expert_parallel:
        notes.append(f"MoE: experts spread over each instance's TP group (EP {p.tp} prefill, EP {d.tp} decode)")
    notes.append("import assumes the staging copy of kvserve's shared-memory transfer; a zero-copy (NIXL) "
                 "transport removes it")
    return notes
