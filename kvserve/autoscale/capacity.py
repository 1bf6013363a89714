"""One replica's capacity at the SLO, derived from the planner's pure functions.

A replica that only decodes, at the largest batch ``b`` whose decode step meets the TPOT SLO
within its KV pool (``candidates.max_batch_within``; the step from ``roofline.step_time`` at the
workload's mean decode context ``prompt + output / 2``), produces::

    decode tokens/s per replica = b / t_step(b)

A replica that only prefills mean prompts of ``P`` tokens (chunks of ``max_batched_tokens``,
``candidates.prefill_s``) computes ``P / t_prefill(P)`` prompt tokens/s; the TTFT SLO caps the
fraction of its time it may spend prefilling (the planner's ``fleet.ttft_p99``:
``TTFT p99 = t_step + t_prefill(P99) / (1 - rho)``, solved for rho, at most 0.95)::

    rho_max = min(0.95, 1 - t_prefill(P99) / (TTFT_SLO - t_step(b)))       (1.0 without a TTFT SLO)
    prefill tokens/s per replica = P / t_prefill(P) x rho_max

The hardware is whatever the plan inputs name: a catalog GPU (its roofline) or the entry
``kvserve profile`` measured and saved (``planner.hardware.load_hardware_file``), so the capacity
is calibrated where a profile exists and never guessed.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from kvserve.autoscale.errors import AutoscaleInputError
from kvserve.planner.candidates import Candidate, PlanInputs, prefill_s
from kvserve.planner.errors import ImpossibleInputError, PlannerInputError
from kvserve.planner.figures import fmt_seconds

MAX_PREFILL_UTILISATION = 0.95   # the planner's cap on rho in fleet.ttft_p99


@dataclass(frozen=True)
class ReplicaCapacity:
    """Tokens/s one replica serves within the SLO: prompt tokens computed (prefill) and output
    tokens (decode), each as if the replica did only that work."""

    prefill_tokens_per_s: float
    decode_tokens_per_s: float
    arithmetic: str = ""

    def __post_init__(self) -> None:
        for name in ("prefill_tokens_per_s", "decode_tokens_per_s"):
            value = getattr(self, name)
            if not (value > 0 and math.isfinite(value)):
                raise AutoscaleInputError(f"replica capacity {name} must be a positive number, got {value}",
                                          param=name)

    def load(self, prefill_tokens_per_s: float, decode_tokens_per_s: float) -> float:
        """Replica-equivalents of a demand: each phase's tokens/s over this capacity, summed."""
        return prefill_tokens_per_s / self.prefill_tokens_per_s + decode_tokens_per_s / self.decode_tokens_per_s


def prefill_utilisation_at_ttft(step_s: float, prefill_p99_s: float, ttft_p99_s: float | None) -> float:
    """``min(0.95, 1 - t_prefill(P99) / (TTFT_SLO - t_step))``; 1.0 without a TTFT SLO.
    Raises ImpossibleInputError when even an idle replica misses the SLO."""
    if ttft_p99_s is None:
        return 1.0
    slack = ttft_p99_s - step_s
    rho = 1.0 - prefill_p99_s / slack if slack > 0 else 0.0
    if rho <= 0:
        raise ImpossibleInputError(
            f"TTFT SLO {fmt_seconds(ttft_p99_s)} is below one decode step {fmt_seconds(step_s)} + a p99 prefill "
            f"{fmt_seconds(prefill_p99_s)} on an idle replica: no load meets it", param="ttft_p99_s")
    return min(MAX_PREFILL_UTILISATION, rho)


def capacity_from_candidate(inp: PlanInputs, chosen: Candidate) -> ReplicaCapacity:
    """The capacity of the replica ``chosen`` describes (its TP, batch at the TPOT SLO, step and
    prefill times), under ``inp``'s workload (formulas in the module docstring)."""
    w = inp.workload
    prompt = w.prompt_tokens()
    decode = chosen.batch / chosen.step_s
    prefill_p99 = prefill_s(chosen.cm, prompt.p99, inp.options.max_batched_tokens)
    rho_max = prefill_utilisation_at_ttft(chosen.step_s, prefill_p99, w.ttft_p99_s)
    prefill_raw = prompt.mean / chosen.prefill_s
    prefill = prefill_raw * rho_max
    text = (f"{inp.model.name} on {inp.hw.name}, TP {chosen.tp}: decode = batch {chosen.batch} / step "
            f"{fmt_seconds(chosen.step_s)} = {decode:,.1f} tokens/s; prefill = {prompt.mean:g} tokens / "
            f"{fmt_seconds(chosen.prefill_s)} = {prefill_raw:,.1f} tokens/s x rho_max {rho_max:.3f} = "
            f"{prefill:,.1f} tokens/s")
    if chosen.slo_violations:
        text += f" (SLO missed even so: {'; '.join(chosen.slo_violations)})"
    return ReplicaCapacity(prefill, decode, text)


def replica_capacity(inp: PlanInputs) -> ReplicaCapacity:
    """One replica's capacity at the SLO for ``inp`` (traffic mode: ``rps``, prompt and output
    lengths, ``tpot_s`` and/or ``ttft_p99_s``). The TP degree is the planner's choice
    (``make_plan``), or ``inp.options.tp`` when forced."""
    from kvserve.planner.plan import make_plan   # the planner's entry point (pure, torch-free)

    if not inp.workload.traffic_mode:
        raise PlannerInputError("a replica's capacity at the SLO needs traffic mode: set rps, prompt and "
                                "output tokens, and the TPOT / TTFT SLOs", param="rps")
    return capacity_from_candidate(inp, make_plan(inp).chosen)
