"""Plots for ``kvserve plan --plot DIR``: memory by TP degree, decode throughput vs batch."""
from __future__ import annotations

import os

from kvserve.planner.plan import Plan, _decode_context
from kvserve.planner.roofline import decode_work, step_time

GiB = 2**30


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_memory(plan: Plan, path: str) -> str:
    """Stacked bars per TP degree: weights / reserve / KV pool / held back, per GPU, in GiB."""
    plt = _pyplot()
    hw = plan.inputs.hw
    limit = max(hw.gpus_per_node, plan.chosen.tp)
    cands = [c for c in plan.candidates if c.tp <= limit]
    labels = [f"TP {c.tp}" + (" *" if c.tp == plan.chosen.tp else "") for c in cands]
    weights = [c.memory.weights_per_gpu / GiB for c in cands]
    reserve = [c.memory.reserve_per_gpu / GiB for c in cands]
    kv = [max(0.0, c.memory.kv_pool_per_gpu) / GiB for c in cands]
    held = (1 - hw.memory_utilization) * hw.memory_bytes / GiB
    fig, ax = plt.subplots(figsize=(8.5, 4), dpi=90)
    x = range(len(cands))
    ax.bar(x, weights, label="weights", color="#4c72b0")
    ax.bar(x, reserve, bottom=weights, label="runtime + activations", color="#dd8452")
    bottom = [w + r for w, r in zip(weights, reserve)]
    ax.bar(x, kv, bottom=bottom, label="KV pool", color="#55a868")
    ax.bar(x, [held] * len(cands), bottom=[b + k for b, k in zip(bottom, kv)],
           label=f"held back ({1 - hw.memory_utilization:.0%})", color="#cccccc")
    ax.axhline(hw.memory_bytes / GiB, color="black", lw=1, ls="--")
    for i, c in enumerate(cands):
        ax.text(i, hw.memory_bytes / GiB * 1.01, f"{c.memory.max_concurrency} seqs", ha="center", fontsize=8)
    ax.set_xticks(list(x), labels)
    ax.set_ylabel("GiB per GPU")
    ax.set_title(f"{plan.inputs.model.name} on {hw.name}: memory per GPU by TP (* chosen)", fontsize=10)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


def plot_roofline(plan: Plan, path: str) -> str:
    """Output tokens/s per GPU vs decode batch: the planner's estimate and the peak roofline."""
    plt = _pyplot()
    c = plan.chosen
    ctx = _decode_context(plan.inputs)
    ridge = plan.figure("ridge_batch").value
    max_b = max(4, min(4096, int(max(2 * ridge, 2 * c.memory.max_concurrency))))
    batches = sorted({int(round(1.25 ** i)) for i in range(0, 64) if 1.25 ** i <= max_b})
    est = [b / step_time(c.cm, decode_work(b, ctx)).total_s / c.tp for b in batches]
    peak = [b / step_time(c.cm, decode_work(b, ctx), peak=True).total_s / c.tp for b in batches]
    bw_only = [b / (step_time(c.cm, decode_work(b, ctx), peak=True).weights_s
                    + step_time(c.cm, decode_work(b, ctx), peak=True).kv_s) / c.tp for b in batches]
    compute_cap = c.cm.flops / (2 * (c.cm.active_body_params + c.cm.lm_params) / c.tp) / c.tp
    fig, ax = plt.subplots(figsize=(7, 4), dpi=90)
    ax.plot(batches, bw_only, ls=":", color="#4c72b0", label="bandwidth roof (weights + KV reads)")
    ax.axhline(compute_cap, ls=":", color="#c44e52", label="compute roof (2 x active params FLOPs)")
    ax.plot(batches, peak, color="black", lw=1, label="roofline at 100% of peaks")
    ax.plot(batches, est, color="#55a868", lw=2, label="planner estimate (efficiencies, overheads)")
    ax.axvline(ridge, color="#8172b3", ls="--", lw=1, label=f"ridge batch {ridge:,.0f}")
    if c.memory.max_concurrency:
        ax.axvline(c.memory.max_concurrency, color="#937860", ls="-.", lw=1,
                   label=f"KV-limited batch {c.memory.max_concurrency}")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("decode batch (sequences)")
    ax.set_ylabel("output tokens/s per GPU")
    ax.set_title(f"{plan.inputs.model.name} on {plan.inputs.hw.name}, TP {c.tp}, context {ctx:,.0f}", fontsize=10)
    ax.legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


def write_plots(plan: Plan, directory: str) -> list[str]:
    """Both plots into ``directory`` (created); returns their paths."""
    os.makedirs(directory, exist_ok=True)
    return [plot_memory(plan, os.path.join(directory, "planner_memory.png")),
            plot_roofline(plan, os.path.join(directory, "planner_roofline.png"))]
