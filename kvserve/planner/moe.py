"""Mixture-of-experts serving figures: total vs active parameters, experts per GPU under
expert parallelism, and the all-to-all cost per layer from the interconnect."""
from __future__ import annotations

from dataclasses import dataclass

from kvserve.planner.errors import PlannerInputError
from kvserve.planner.figures import Figure, fmt_bytes, fmt_rate, fmt_seconds
from kvserve.planner.hardware import HardwareSpec
from kvserve.planner.models import ModelSpec, active_params, param_counts


@dataclass(frozen=True)
class MoEFigures:
    total_params: Figure
    active_params: Figure
    experts_per_gpu: Figure
    all_to_all_per_layer: Figure
    all_to_all_per_step: Figure


def experts_per_gpu(num_experts: int, ep: int) -> int:
    """Routed experts each GPU holds when ``ep`` GPUs share them (``ep`` must divide them)."""
    if ep < 1 or num_experts % ep:
        raise PlannerInputError(f"expert-parallel degree {ep} does not divide {num_experts} experts",
                                param="expert_parallel")
    return num_experts // ep


def all_to_all_s(model: ModelSpec, hw: HardwareSpec, ep: int, tokens_per_gpu: int,
                 act_bytes: float = 2.0) -> tuple[float, float]:
    """(bytes each GPU sends, seconds) for one layer's dispatch + combine all-to-all.

    Each token goes to ``k`` experts; with experts spread evenly a fraction (ep-1)/ep of
    those copies leave the GPU, on the way there (dispatch) and back (combine).
    """
    assert model.moe is not None
    if ep == 1:
        return 0.0, 0.0
    k = model.moe.experts_per_token
    sent = 2 * tokens_per_gpu * k * model.hidden_size * act_bytes * (ep - 1) / ep
    bw, latency = hw.all_to_all_link()
    link = bw if ep <= hw.gpus_per_node else min(bw, 50e9)
    return sent, sent / max(link, 1.0) + 2 * latency


def moe_figures(model: ModelSpec, hw: HardwareSpec, ep: int, tokens_per_gpu: int,
                included: bool = False) -> MoEFigures | None:
    """The MoE block of a plan (None for dense models). ``included``: the step times count the
    all-to-all (``--expert-parallel``); otherwise experts are TP-sharded and it is for comparison."""
    if model.moe is None:
        return None
    e = model.moe
    c = param_counts(model)
    act = active_params(model, c)
    total = Figure("total_params", float(c.total), "params",
                   f"{c.total - c.routed_experts:,} shared + {c.num_moe_layers} MoE layers x {e.num_experts} experts"
                   f" x {c.expert_params_each:,} = {c.total:,}")
    active = Figure("active_params", float(act), "params",
                    f"{c.total - c.routed_experts:,} shared + {c.num_moe_layers} x {e.experts_per_token} routed "
                    f"x {c.expert_params_each:,} = {act:,} ({act / c.total:.1%} of total)")
    per_gpu = experts_per_gpu(e.num_experts, ep)
    epg = Figure("experts_per_gpu", float(per_gpu), "experts",
                 f"{e.num_experts} experts / EP {ep} = {per_gpu} per GPU per layer")
    sent, secs = all_to_all_s(model, hw, ep, tokens_per_gpu)
    link, latency = hw.all_to_all_link()
    a2a = Figure("all_to_all_s_per_layer", secs, "s",
                 f"2 (dispatch+combine) x {tokens_per_gpu} tokens x {e.experts_per_token} experts x "
                 f"{model.hidden_size} x 2 B x ({ep}-1)/{ep} = {fmt_bytes(sent)} / "
                 f"{fmt_rate(link, 'B/s')} + 2 x {fmt_seconds(latency)} "
                 f"= {fmt_seconds(secs)}")
    how = ("included in the step time (--expert-parallel)" if included
           else "not in the step time: experts are TP-sharded unless --expert-parallel")
    per_step = secs * c.num_moe_layers
    step = Figure("all_to_all_s_per_step", per_step, "s",
                  f"{c.num_moe_layers} MoE layers x {fmt_seconds(secs)} = {fmt_seconds(per_step)}; {how}")
    return MoEFigures(total, active, epg, a2a, step)
