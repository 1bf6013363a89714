"""Render a Plan for people: a table of figures, each followed by the arithmetic behind it."""
from __future__ import annotations

import textwrap

from kvserve.planner.figures import Figure, fmt_bytes, fmt_num
from kvserve.planner.plan import Plan

WIDTH = 100          # fixed, so the output (and docs/planner.md) does not depend on the terminal

SECTIONS = (
    ("Model", ("total_params", "active_params", "weight_bytes", "kv_bytes_per_token")),
    ("Memory and parallelism", ("tp", "kv_bytes_per_token_per_gpu", "kv_tokens_per_replica", "max_concurrency")),
    ("Speed (roofline)", ("decode_ms_per_token_bs1", "decode_bound_ms_per_token_bs1", "ridge_batch", "prefill_ms",
                          "batch_per_replica", "tpot_ms", "ttft_ms", "ttft_p99_ms", "output_tokens_per_s_per_gpu")),
    ("Fleet and cost", ("replicas", "gpus", "usd_per_month", "usd_per_million_output_tokens",
                        "usd_per_million_output_tokens_at_capacity")),
    ("Speculative decoding", ("spec_expected_tokens_per_step", "spec_speedup", "spec_breakeven_batch")),
    ("Mixture of experts", ("ep", "experts_per_gpu", "all_to_all_s_per_layer", "all_to_all_s_per_step")),
)


def format_value(f: Figure) -> str:
    """The value with its unit, in the unit people read it in."""
    if f.unit == "B":
        return f"{f.value:,.0f} B ({fmt_bytes(f.value)})" if f.value >= 1024 else f"{f.value:,.0f} B"
    if f.unit == "$":
        return f"${f.value:,.2f}" if f.value >= 0.01 else f"${f.value:.4g}"
    if f.unit == "params":
        return f"{f.value / 1e9:,.2f} B params" if f.value >= 1e9 else f"{f.value / 1e6:,.1f} M params"
    if f.unit == "s":
        return f"{f.value * 1e3:,.3g} ms"
    if f.unit == "x":
        return f"{f.value:.3g}x"
    return f"{fmt_num(f.value)} {f.unit}"


def render_sections(figures, sections, format_figure) -> list[str]:
    """Lines of one titled section per ``(title, figure names)`` present in ``figures``: each
    figure's value (``format_figure``) with its arithmetic wrapped under it."""
    lines, by_name = [], {f.name: f for f in figures}
    for title, names in sections:
        rows = [by_name[n] for n in names if n in by_name]
        if not rows:
            continue
        lines += ["", title, "-" * len(title)]
        for f in rows:
            lines.append(f"  {f.name:<40} {format_figure(f)}")
            lines += textwrap.wrap(f.arithmetic, width=WIDTH, initial_indent="      = ",
                                   subsequent_indent="        ")
    return lines


def render_table(plan: Plan) -> str:
    """The plan as text: a header, one section per concept, arithmetic under each figure."""
    inp = plan.inputs
    wd = inp.weight_dtype.name if inp.weight_dtype else "native"
    w = inp.workload
    load = (f"{w.rps:g} req/s (peak x{w.peak_to_mean:g}), prompt {w.prompt_tokens().text}, output "
            f"{w.output_tokens().text}" if w.traffic_mode else f"{w.concurrency} seqs x {w.context:,} tokens")
    lines = [f"kvserve plan: {inp.model.name} ({inp.model.attention_kind.upper()}) on {inp.hw.name}, "
             f"weights {wd}, KV {inp.kv_dtype.name}; {load}",
             f"  model numbers: {inp.model.source}", f"  hardware: {inp.hw.source or 'custom entry'}"]
    lines += render_sections(plan.figures, SECTIONS, format_value)
    lines += ["", "Memory by TP degree", "-------------------",
              f"  {'TP':>3} {'weights/GPU':>12} {'reserve/GPU':>12} {'KV pool/GPU':>12} {'KV tokens':>12} "
              f"{'max seqs':>9} {'replicas':>9} {'GPUs':>5}"]
    for c in plan.candidates:
        if c.tp > max(inp.hw.gpus_per_node, plan.chosen.tp):
            continue
        m = c.memory
        mark = " <- chosen" if c.tp == plan.chosen.tp else ("" if c.fits else " (does not fit)")
        lines.append(f"  {c.tp:>3} {fmt_bytes(m.weights_per_gpu):>12} {fmt_bytes(m.reserve_per_gpu):>12} "
                     f"{fmt_bytes(max(0.0, m.kv_pool_per_gpu)):>12} {m.kv_tokens:>12,} {m.max_concurrency:>9} "
                     f"{int(c.replicas.value) if c.fits else '-':>9} {c.gpus if c.fits else '-':>5}{mark}")
    for note in plan.notes:
        lines.append(f"note: {note}")
    return "\n".join(lines)
