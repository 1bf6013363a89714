"""Render a DisaggPlan for people: the unified plan's table, then the disaggregated layout's figures,
each with the arithmetic behind it."""
from __future__ import annotations

from kvserve.planner.disagg import DisaggPlan
from kvserve.planner.figures import Figure
from kvserve.planner.report import format_value, render_sections, render_table

DISAGG_SECTIONS = (
    ("Disaggregated: prefill instances", ("prefill_tp", "prefill_mean_ms", "prefill_utilisation",
                                          "prefill_capacity_tokens_per_s", "prefill_instances", "disagg_ttft_p99_ms")),
    ("Disaggregated: decode instances", ("decode_tp", "decode_batch_per_instance", "decode_tpot_ms",
                                         "decode_capacity_tokens_per_s", "decode_instances")),
    ("Disaggregated: KV transfer", ("kv_transfer_bytes_per_request", "kv_transfer_ms_per_request",
                                    "kv_transfer_ms_p99", "kv_import_ms_per_request")),
    ("Disaggregated: threshold rule", ("disagg_breakeven_prompt_tokens", "unified_tpot_break_prompt_tokens")),
    ("Unified vs disaggregated", ("unified_gpus", "disagg_gpus", "unified_usd_per_month", "disagg_usd_per_month",
                                  "disagg_usd_per_million_output_tokens", "unified_tpot_p99_burst_ms",
                                  "disagg_tpot_p99_burst_ms", "tpot_p99_burst_ratio")),
)


def _format(f: Figure) -> str:
    """``format_value``, with large rates as whole numbers (31,590 tokens/s, not 3.159e+04)."""
    if f.unit == "tokens/s" and f.value >= 1e4:
        return f"{f.value:,.0f} {f.unit}"
    return format_value(f)


def render_disagg_table(plan: DisaggPlan) -> str:
    """The unified table followed by one section per part of the disaggregated layout."""
    lines = [render_table(plan.unified)]
    lines += render_sections(plan.figures, DISAGG_SECTIONS, _format)
    lines += ["", "Disaggregated instances by TP", "-----------------------------",
              f"  {'TP':>3} {'prefill inst':>13} {'GPUs':>5} {'TTFT p99':>10}   {'decode inst':>12} {'batch':>6} "
              f"{'TPOT':>9} {'GPUs':>5}"]
    widest = max(plan.unified.inputs.hw.gpus_per_node, plan.prefill.tp, plan.decode.tp)
    for p, d in zip(plan.prefill_options, plan.decode_options):
        if p.tp > widest:
            continue
        pre = (f"{int(p.instances.value):>13} {p.gpus:>5} {p.ttft.value:>7.4g} ms" if p.memory.fits
               else f"{'-':>13} {'-':>5} {'-':>10}")
        dec = (f"{int(d.instances.value):>12} {d.batch:>6} {d.step_s * 1e3:>6.3g} ms {d.gpus:>5}" if d.memory.fits
               else f"{'-':>12} {'-':>6} {'-':>9} {'-':>5}")
        marks = [m for m, hit in (("prefill", p is plan.prefill), ("decode", d is plan.decode)) if hit]
        lines.append(f"  {p.tp:>3} {pre}   {dec}" + (f" <- {' + '.join(marks)}" if marks else ""))
    for note in plan.notes:
        lines.append(f"note: {note}")
    return "\n".join(lines)
