"""Speculative decoding: tokens per verification step and the net speedup at a batch size.

A draft proposes ``k`` tokens; the target verifies them in one forward of ``k + 1``
tokens per sequence. With i.i.d. acceptance ``alpha`` the expected tokens emitted per
step are (Leviathan et al. 2023, eq. 1)::

    E = (1 - alpha^(k+1)) / (1 - alpha)

A step costs ``k`` draft forwards (each ``c`` target decode steps) plus the verify
forward. At small batch the verify costs about one decode step (memory-bound), so
speculation pays; at large batch the verify's ``k + 1`` tokens per sequence are
compute-bound and cost ~``k + 1`` steps, so it stops paying.
"""
from __future__ import annotations

from dataclasses import dataclass

from kvserve.planner.figures import Figure, fmt_seconds
from kvserve.planner.roofline import CostModel, StepWork, decode_work, step_time
from kvserve.planner.workload import SpecConfig


def expected_tokens_per_step(alpha: float, k: int) -> Figure:
    """(1 - alpha^(k+1)) / (1 - alpha); k + 1 when every draft is accepted."""
    if alpha >= 1.0:
        return Figure("spec_expected_tokens_per_step", float(k + 1), "tokens",
                      f"alpha = 1: all {k} drafts accepted + 1 bonus = {k + 1}")
    value = (1 - alpha ** (k + 1)) / (1 - alpha)
    return Figure("spec_expected_tokens_per_step", value, "tokens",
                  f"(1 - {alpha:g}^({k}+1)) / (1 - {alpha:g}) = {value:.4g}")


def leviathan_speedup(alpha: float, k: int, c: float) -> float:
    """Walltime improvement when verification costs one target step: E / (k c + 1)."""
    return expected_tokens_per_step(alpha, k).value / (k * c + 1)


@dataclass(frozen=True)
class SpecResult:
    expected_tokens: Figure
    speedup: Figure
    breakeven_batch: Figure          # first batch where speedup < 1 (inf if never within the search)


def spec_step_s(cm: CostModel, spec: SpecConfig, batch: int, context: float) -> tuple[float, float]:
    """(plain decode step, speculative step) seconds at ``batch`` x ``context``."""
    plain = step_time(cm, decode_work(batch, context)).total_s
    verify = step_time(cm, StepWork(batch * (spec.k + 1), batch,
                                    ((batch * (context + spec.k), batch * (spec.k + 1) * context),))).total_s
    return plain, spec.k * spec.draft_cost * plain + verify


def speculative(cm: CostModel, spec: SpecConfig, batch: int, context: float,
                max_batch: int = 4096) -> SpecResult:
    """Expected tokens, the speedup at ``batch``, and the batch past which speculation loses."""
    e = expected_tokens_per_step(spec.alpha, spec.k)
    plain, spec_s = spec_step_s(cm, spec, batch, context)
    speedup = e.value * plain / spec_s
    verify = spec_s - spec.k * spec.draft_cost * plain
    sp = Figure("spec_speedup", speedup, "x",
                f"E x t_step / (k c t_step + t_verify) = {e.value:.4g} x {fmt_seconds(plain)} / "
                f"({spec.k} x {spec.draft_cost:g} x {fmt_seconds(plain)} + {fmt_seconds(verify)}"
                f" verify of {spec.k + 1} tokens/seq) = {speedup:.3g}x at batch {batch}")

    def gain(b: int) -> float:
        p, s = spec_step_s(cm, spec, b, context)
        return e.value * p / s

    lo, hi = 1, 1
    while hi <= max_batch and gain(hi) >= 1:
        lo, hi = hi, hi * 2
    if hi > max_batch and gain(max_batch) >= 1:
        be = Figure("spec_breakeven_batch", float("inf"), "seqs",
                    f"speculation still pays at batch {max_batch}, the largest the KV pool and "
                    f"max_num_seqs allow (speedup {gain(max_batch):.3g}x there)")
    else:
        hi = min(hi, max_batch)
        if gain(1) < 1:
            lo, hi = 0, 1
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if gain(mid) >= 1 else (lo, mid)
        be = Figure("spec_breakeven_batch", float(hi), "seqs",
                    f"first batch where E x t_step < k c t_step + t_verify: {hi} "
                    f"(speedup {gain(hi):.3g}x there)")
    return SpecResult(e, sp, be)
