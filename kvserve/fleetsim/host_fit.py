"""The host as a running cluster's engines see it: how much slower they step than the profile,
and what the serving path adds to every first token.

``kvserve profile`` times the engine alone. Inside the local Ray cluster the same engine shares
the host with its replica actor, the ingress, Ray's proxy and Ray's own processes, and every
streamed token crosses those processes: on a two-core machine its steps run slower than the
profile says, and every request's first token pays the hops. Both are measured in place, before
a trace, by a probe through the running cluster (``probe_trace``: requests one at a time, with
prompts of four lengths, then a batch, at once or as a stream whose new prefills join the
decoding batch as a busy trace's do) that the simulator also plays:

- ``slowdown`` = the decode steps' factor (the hardware entry's memory bandwidth divided by it,
  its overheads multiplied, ``slowed``), from the one-at-a-time requests' median TPOT;
- ``seq_extra_s`` = what each sequence of a step costs beyond the profile's figure, from the
  batch's median TPOT (``kvserve profile --quick`` fits its per-sequence cost on short contexts,
  and an error there is an error on every step of a busy replica); the two are solved together
  by Newton steps on finite differences.
  Where the batch is cheaper than the slowed profile says (the solve wants a negative extra), the
  extra is 0 and the one factor is fitted on the batch, not the single requests: a busy replica
  runs batches, and a factor from the singles overstated a trace's service by 6-18% in two runs
  of four (its TTFT p99 1.56x);
- ``prefill_slowdown`` (the entry's FLOP rates divided by it) and ``path_latency_s`` (the
  ingress / proxy / actor hops, added to every TTFT) = the slope and intercept of the
  one-at-a-time requests' measured TTFT against their simulated one: one prompt length could not
  tell a slower prefill from a longer path, four lengths (64-384 tokens) can.

Decode is bandwidth-bound and prefill compute-bound, so the two factors barely touch each
other's medians; the fit alternates between them. The simulator then plays the trace on the
fitted entry, its requests reaching the replica ``path_latency_s`` after they are sent
(``cluster_check.simulate_autoscaled``). The fit reads the probe only, never the trace it is
compared with.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Callable

import numpy as np

from kvserve.fleetsim.log import RequestLog
from kvserve.planner.hardware import HardwareSpec


SINGLE_PROMPTS = (64, 128, 256, 384)


def probe_trace(batch: int, prompt_tokens: int = 128, output_tokens: int = 24,
                single_prompts: tuple[int, ...] = SINGLE_PROMPTS, gap_s: float = 3.0,
                batch_gap_s: float = 0.0) -> RequestLog:
    """One request per ``single_prompts`` length ``gap_s`` apart (each done before the next is
    sent), then ``batch`` requests of ``prompt_tokens``, at once or ``batch_gap_s`` apart (a
    stream that keeps a replica's batch full of decodes and new prefills, as a busy trace does);
    all of ``output_tokens``."""
    singles = len(single_prompts)
    arrivals = [i * gap_s for i in range(singles)] + [singles * gap_s + i * batch_gap_s for i in range(batch)]
    prompts = list(single_prompts) + [prompt_tokens] * batch
    n = len(arrivals)
    return RequestLog(arrivals, [0] * n, [0] * n, prompts, [output_tokens] * n)


def slowed(hw: HardwareSpec, factor: float, seq_extra_s: float = 0.0,
           prefill_factor: float | None = None) -> HardwareSpec:
    """``hw`` with its memory bandwidth divided by ``factor``, its FLOP rates by
    ``prefill_factor`` (``factor`` when None), every host overhead multiplied by ``factor``, and
    ``seq_extra_s`` more per sequence in a step."""
    compute = factor if prefill_factor is None else prefill_factor
    return dataclasses.replace(
        hw, name=f"{hw.name} (x{factor:.2f} slower in place)", mem_bandwidth=hw.mem_bandwidth / factor,
        flops={k: v / compute for k, v in hw.flops.items()}, step_overhead_s=hw.step_overhead_s * factor,
        seq_overhead_s=hw.seq_overhead_s * factor + seq_extra_s, request_overhead_s=hw.request_overhead_s * factor)


@dataclass(frozen=True)
class HostFit:
    """The probe's fit (the module docstring); the medians it came from, in seconds."""

    slowdown: float
    seq_extra_s: float
    prefill_slowdown: float
    path_latency_s: float
    measured_tpot_s: float          # one-at-a-time requests
    profile_tpot_s: float           # the same, simulated on the profile
    measured_batch_tpot_s: float    # the batch's requests
    fitted_batch_tpot_s: float      # the same, simulated on the fit
    measured_ttft_s: float          # one-at-a-time requests
    slowed_ttft_s: float            # the same, simulated on the fit (no path)

    def as_dict(self) -> dict:
        return {k: round(v, 5) for k, v in dataclasses.asdict(self).items()}


def _tpot(log: RequestLog, one_at_a_time: int) -> tuple[float, float]:
    """Median TPOT of the one-at-a-time requests and of the batch."""
    tpot = log.arrays()["tpot_s"]
    return float(np.median(tpot[:one_at_a_time])), float(np.median(tpot[one_at_a_time:]))


def _fit_on_batch(batch_tpot: float, simulate: Callable[[float, float], RequestLog], one_at_a_time: int,
                  slowdown: float, rounds: int) -> float:
    """The one decode factor (no per-sequence extra) whose simulated batch TPOT median is
    ``batch_tpot``: ``rounds`` ratio steps from ``slowdown``."""
    for _ in range(rounds):
        slowdown *= batch_tpot / _tpot(simulate(slowdown, 0.0), one_at_a_time)[1]
    return slowdown


def _fit_decode(target: np.ndarray, simulate: Callable[[float, float], RequestLog], one_at_a_time: int,
                rounds: int, per_sequence: bool = True) -> tuple[float, float]:
    """(slowdown, seq_extra_s) whose simulated TPOT medians (one sequence, the batch) are ``target``:
    Newton steps on the Jacobian measured by finite differences (a step is about ``slowdown x
    profile + sequences x seq_extra_s``, where the batch's sequences per step depend on how its
    requests arrive); without ``per_sequence``, one factor fitted on the batch (extra 0)."""
    if not per_sequence:
        return _fit_on_batch(float(target[1]), simulate, one_at_a_time, 1.0, rounds + 1), 0.0
    slowdown, extra = 1.0, 0.0
    for _ in range(rounds + 1):
        at = np.array(_tpot(simulate(slowdown, extra), one_at_a_time))
        residual = target - at
        jacobian = np.column_stack([(np.array(_tpot(simulate(slowdown * 1.01, extra), one_at_a_time)) - at)
                                    / (0.01 * slowdown),
                                    (np.array(_tpot(simulate(slowdown, extra + 1e-3), one_at_a_time)) - at) / 1e-3])
        step = np.linalg.solve(jacobian, residual)
        slowdown, extra = slowdown + float(step[0]), extra + float(step[1])
        if extra < 0:     # the batch is no dearer than the profile says: one factor, fitted on the batch
            slowdown, extra = _fit_on_batch(float(target[1]), simulate, one_at_a_time, slowdown, 1), 0.0
    return slowdown, extra


def _fit_prefill(measured_ttft: np.ndarray, simulate: Callable[[float], RequestLog], one_at_a_time: int,
                 start: float, rounds: int) -> tuple[float, float]:
    """(prefill_slowdown, path_latency_s) by least squares of ``measured_ttft`` = path + the
    singles' TTFT simulated at that factor (Gauss-Newton from ``start``, 0); a negative path is
    refitted at 0 (the first tokens come no later than the prefills say). Where no single's
    prefill depends on the FLOP rate (all bandwidth-bound) the factor stays where it started."""
    def ttft(factor: float) -> np.ndarray:
        return simulate(factor).arrays()["ttft_s"][:one_at_a_time]

    factor, path = start, 0.0
    for fit_path in (True, False):
        for _ in range(rounds + 1):
            base = ttft(factor)
            slope = (ttft(factor * 1.01) - base) / (0.01 * factor)
            residual = measured_ttft - base - path
            if not slope @ slope > 1e-18:            # no single's prefill depends on the FLOP rate
                path += float(np.mean(residual)) if fit_path else 0.0
                break
            if fit_path:
                step = np.linalg.lstsq(np.column_stack([slope, np.ones_like(base)]), residual, rcond=None)[0]
                factor, path = max(0.05, factor + float(step[0])), path + float(step[1])
            else:
                factor = max(0.05, factor + float(slope @ residual / (slope @ slope)))
        if path >= 0:
            break
        path = 0.0
    return factor, path


def fit_host(measured: RequestLog, simulate: Callable[[float, float, float], RequestLog], one_at_a_time: int,
             rounds: int = 3, per_sequence: bool = True) -> HostFit:
    """Fit ``HostFit`` from the probe's measured log and ``simulate(slowdown, seq_extra_s,
    prefill_slowdown)``, the same probe simulated on the hardware entry ``slowed`` by those; the
    first ``one_at_a_time`` requests are the unqueued ones (of at least two prompt lengths), the
    rest one batch. Decode and prefill are fitted in turn, twice (the module docstring); without
    ``per_sequence`` the decode is one factor fitted on the batch (``seq_extra_s`` 0)."""
    got = measured.arrays()
    if np.isnan(got["ttft_s"]).any():
        raise RuntimeError("the probe was not fully served: the cluster is not healthy")
    if len(set(measured.prompt[:one_at_a_time])) < 2:
        raise ValueError("the probe's one-at-a-time requests need two prompt lengths or more")
    target = np.array(_tpot(measured, one_at_a_time))
    profile = np.array(_tpot(simulate(1.0, 0.0, 1.0), one_at_a_time))
    measured_ttft = got["ttft_s"][:one_at_a_time]
    prefill = None                          # first round: prefill slowed as decode is
    for _ in range(2):
        slowdown, extra = _fit_decode(target, lambda f, e: simulate(f, e, f if prefill is None else prefill),
                                      one_at_a_time, rounds, per_sequence)
        prefill, path = _fit_prefill(measured_ttft, lambda p: simulate(slowdown, extra, p), one_at_a_time,
                                     slowdown if prefill is None else prefill, rounds)
    fitted = simulate(slowdown, extra, prefill)
    sim_ttft = fitted.arrays()["ttft_s"][:one_at_a_time]
    return HostFit(slowdown, extra, prefill, path, float(target[0]), float(profile[0]), float(target[1]),
                   _tpot(fitted, one_at_a_time)[1], float(np.median(measured_ttft)), float(np.median(sim_ttft)))
