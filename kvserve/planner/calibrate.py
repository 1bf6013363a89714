"""Fit the roofline's efficiency factors to kvserve's measured run times (pure numpy).

Each measured run (``batch`` prompts of ``prompt`` tokens, ``max_tokens`` outputs, all
at once) is run through the engine's own scheduler (:mod:`simulate`), giving its steps.
Per step the roofline at 100% efficiency gives weight-stream seconds A, GEMM seconds B,
and per attention kernel KV seconds C and attention-FLOP seconds D. The predicted run time is::

    s2 x requests + sum over steps of
        s0 + s1 x sampled seqs + max(A / e_mem, B / e_flops) + sum max(C / e_kv, D / e_flops)

except that one-token steps (a single decode) stream weights through matrix-vector
kernels, which run at the measured streaming bandwidth (the profile's matrix-vector
benchmark is exactly that kernel): their GEMM term is A (e_gemv = 1). Pinning it keeps the
per-step host overhead s0 identifiable (otherwise s0 and the weight time, both paid once per
step, trade off freely). A grid over (e_mem, e_flops, e_kv) in (0, 1], with the host
overheads s0 (per step), s1 (per sequence per step) and s2 (per request) >= 0 solved by
non-negative least squares at each grid point, minimises the squared relative error over runs.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from kvserve.planner.hardware import HardwareSpec
from kvserve.planner.roofline import CostModel, step_time
from kvserve.planner.simulate import SchedulerLimits, schedule_offline, step_work

EFF_GRID = np.geomspace(0.01, 1.0, 36)


@dataclass(frozen=True)
class RunSample:
    """One timed ``generate`` call: prompts of these lengths, ``max_tokens`` outputs each."""

    prompts: tuple[int, ...]
    max_tokens: int
    seconds: float

    def requests(self) -> list[tuple[int, int]]:
        return [(p, self.max_tokens) for p in self.prompts]


@dataclass(frozen=True)
class Fit:
    mem_efficiency: float
    flops_efficiency: float
    kv_efficiency: float
    step_overhead_s: float
    seq_overhead_s: float
    request_overhead_s: float
    gemv_efficiency: float | None
    rms_relative_error: float
    per_run: tuple[dict, ...]


def _features(unit_cm: CostModel, samples: Sequence[RunSample], limits: SchedulerLimits):
    """Per-step and per-kernel seconds at 100% efficiency, with their run indices."""
    mode = unit_cm.hw.kv_read_mode
    a, b, seqs, run_of_step, c, d, step_of_part, single = [], [], [], [], [], [], [], []
    hw, cm = unit_cm.hw, unit_cm
    for r, sample in enumerate(samples):
        for shape in schedule_offline(sample.requests(), limits):
            work = step_work(shape, mode, limits.block_size)
            st = step_time(cm, dataclasses.replace(work, attn=()))
            s = len(a)
            a.append(st.weights_s)
            b.append(st.linear_compute_s)
            seqs.append(work.num_seqs)
            run_of_step.append(r)
            single.append(work.num_tokens == 1)
            for kv, pairs in work.attn:
                c.append(kv * cm.kv_bytes_per_token / hw.mem_bandwidth)
                d.append(pairs * cm.attn_flops_per_pair / cm.tp / cm.flops)
                step_of_part.append(s)
    return tuple(np.asarray(x, dtype=float) for x in (a, b, seqs, run_of_step, c, d, step_of_part, single))


def _best_nonneg(x: np.ndarray, y: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """For every column of ``y`` [runs, G]: non-negative least squares ``y ~ x @ s`` by trying each
    subset of ``x``'s columns. Returns (s [cols, G], rms [G])."""
    n_cols, n_grid = x.shape[1], y.shape[1]
    best_s = np.zeros((n_cols, n_grid))
    best_rms = np.sqrt(np.mean(y ** 2, axis=0))
    for mask in range(1, 2 ** n_cols):
        cols = [j for j in range(n_cols) if mask >> j & 1]
        sub = x[:, cols]
        if np.linalg.matrix_rank(sub) < len(cols):
            continue
        s = np.linalg.pinv(sub) @ y                                   # [len(cols), G]
        rms = np.sqrt(np.mean((y - sub @ s) ** 2, axis=0))
        ok = np.all(s >= 0, axis=0) & (rms < best_rms)
        best_rms = np.where(ok, rms, best_rms)
        full = np.zeros((n_cols, n_grid))
        full[cols] = s
        best_s = np.where(ok[None, :], full, best_s)
    return best_s, best_rms


def _grid_search(feat, meas: np.ndarray, counts: np.ndarray, gm: np.ndarray, gf: np.ndarray, gk: np.ndarray):
    """Best point of the (e_mem, e_flops, e_kv) grid: (rms, e_m, e_f, e_k, coefficients)."""
    a, b, ri, c, d, pr, fixed = feat
    runs = len(meas)
    # lin[r, m, f] = sum over run r's steps of max(A / e_m, B / e_f); att[r, f, k] likewise.
    lin = np.zeros((runs, len(gm), len(gf)))
    np.add.at(lin, ri, np.maximum(a[:, None, None] / gm[None, :, None], b[:, None, None] / gf[None, None, :]))
    att = np.zeros((runs, len(gf), len(gk)))
    np.add.at(att, pr, np.maximum(d[:, None, None] / gf[None, :, None], c[:, None, None] / gk[None, None, :]))
    base = lin[:, :, :, None] + att[:, None, :, :] + fixed[:, None, None, None]   # [runs, m, f, k]
    y = ((meas[:, None, None, None] - base) / meas[:, None, None, None]).reshape(runs, -1)
    s, rms = _best_nonneg(counts / meas[:, None], y)
    i = int(np.argmin(rms))
    i_m, i_f, i_k = np.unravel_index(i, (len(gm), len(gf), len(gk)))
    return float(rms[i]), gm[i_m], gf[i_f], gk[i_k], s[:, i]


def _refine(value: float, step: float) -> np.ndarray:
    return np.unique(np.clip(value * np.geomspace(1 / step, step, 11), 1e-3, 1.0))


def fit_efficiencies(unit_cm: CostModel, samples: Sequence[RunSample], limits: SchedulerLimits,
                     grid: np.ndarray = EFF_GRID) -> Fit:
    """Best (e_mem, e_flops, e_kv, e_gemv, s0, s1, s2) for the measured ``samples`` (module doc):
    a coarse log grid, then a finer one around its best point."""
    a, b, seqs, run, c, d, part_step, single = _features(unit_cm, samples, limits)
    runs = len(samples)
    meas = np.array([s.seconds for s in samples])
    ri = run.astype(int)
    gemv = np.bincount(ri, weights=np.maximum(a, b) * single, minlength=runs)   # 1-token steps at e_gemv = 1
    counts = np.stack([np.bincount(ri, minlength=runs).astype(float),
                       np.bincount(ri, weights=seqs, minlength=runs),
                       np.array([len(s.prompts) for s in samples], dtype=float)], axis=1)
    pr = ri[part_step.astype(int)] if len(c) else np.zeros(0, dtype=int)
    feat = (a * (1 - single), b * (1 - single), ri, c, d, pr, gemv)
    best = _grid_search(feat, meas, counts, grid, grid, grid)
    step = float(grid[1] / grid[0])
    _, e_m, e_f, e_k, _ = best
    best = min(best, _grid_search(feat, meas, counts, _refine(e_m, step), _refine(e_f, step), _refine(e_k, step)),
               key=lambda r: r[0])
    rms, e_m, e_f, e_k, coef = best
    e_gemv = 1.0 if np.any(gemv > 0) else None
    fitted = calibrated_hardware(unit_cm.hw, e_m, e_f, e_k, coef[0], coef[1], coef[2], e_gemv)
    per_run = tuple(_run_report(dataclasses.replace(unit_cm, hw=fitted), x, limits) for x in samples)
    return Fit(float(e_m), float(e_f), float(e_k), float(coef[0]), float(coef[1]), float(coef[2]), e_gemv,
               rms, per_run)


def calibrated_hardware(hw: HardwareSpec, e_mem: float, e_flops: float, e_kv: float,
                        s0: float, s1: float, s2: float = 0.0, e_gemv: float | None = None) -> HardwareSpec:
    """``hw`` with fitted efficiencies and host overheads."""
    return dataclasses.replace(hw, mem_efficiency=float(e_mem), flops_efficiency=float(e_flops),
                               kv_efficiency=float(e_kv), step_overhead_s=float(s0), seq_overhead_s=float(s1),
                               request_overhead_s=float(s2),
                               gemv_efficiency=None if e_gemv is None else float(e_gemv))


def _run_report(cm: CostModel, sample: RunSample, limits: SchedulerLimits) -> dict:
    from kvserve.planner.simulate import predict_seconds

    predicted = predict_seconds(cm, schedule_offline(sample.requests(), limits), limits.block_size) \
        + cm.hw.request_overhead_s * len(sample.prompts)
    return {"prompts": _describe(sample.prompts), "max_tokens": sample.max_tokens,
            "measured_s": round(sample.seconds, 4), "predicted_s": round(predicted, 4),
            "error": round(predicted / sample.seconds - 1, 4)}


def _describe(prompts: Sequence[int]) -> str:
    """``"1x1024 + 15x16"``: prompt lengths, run-length grouped."""
    parts, prev, count = [], None, 0
    for p in list(prompts) + [None]:
        if p == prev:
            count += 1
            continue
        if prev is not None:
            parts.append(f"{count}x{prev}")
        prev, count = p, 1
    return " + ".join(parts)
