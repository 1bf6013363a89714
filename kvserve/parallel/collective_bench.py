"""The collectives of the engine's parallel layers, timed on this host, and the planner's link
models fitted to them: the all-reduce of tensor parallelism (``kvserve profile
--tensor-parallel N``) and the all-to-all of expert parallelism (``--expert-parallel N``).

Rank 0 (this process) and ranks 1..N-1 (fresh interpreters, as a replica's ranks are) join a
``RankGroup`` and call the method the layers call (shared memory between CPU ranks, NCCL on
CUDA) on fp32 tensors of several sizes; rank 0 keeps the best of the repeats per size.
``RankGroup.all_reduce_`` (row-parallel layers): ``fit_link`` fits the planner's model of one
all-reduce (``planner/roofline.allreduce_s``), ``latency + 2 (n - 1) / n x bytes / link``.
``RankGroup.all_to_all`` (an expert-parallel block's dispatch or combine: ``[rows, hidden]``
split evenly over the ranks, with the row bound the block passes): ``fit_all_to_all`` fits the
planner's model of one (``planner/moe.all_to_all_s``), ``latency + (n - 1) / n x bytes / link``.
Both by least squares on the samples.
The ranks' skew (``--tensor-parallel N`` too): every rank runs the same matrix-vector product
between two all-reduces, at several sizes, and rank 0 adds up the ranks' stamped arrivals
(``RankGroup.skew``); ``fit_skew`` fits the spread per call (last arrival over the mean) as
``fixed + cv x e_n x segment`` (``e_n``: the expected largest of n standard normals, so ``cv``
is a rank's compute jitter as a fraction of its segment), and the lag of a forward's start
(rank 0's waits at the first all-reduce after each command of a decode step it sends the
others: the step's work, then the rows to project on the vocabulary).

    python -m kvserve.parallel.collective_bench RANK WORLD STORE_PATH PLAN_JSON   (a worker rank)
"""
from __future__ import annotations

import gc
import json
import os
import subprocess
import sys
import time

import numpy as np

DEFAULT_SIZES = (2**10, 2**12, 2**14, 2**16, 2**18, 2**20)   # fp32 elements: 4 KiB .. 4 MiB
ALL_TO_ALL_HIDDEN = 1024                                      # fp32 per row: 4 KiB
ALL_TO_ALL_ROWS = (1, 4, 16, 64, 256)                         # rows to each rank: 4 KiB .. 1 MiB
SKEW_ROWS = (0, 512, 2048, 4096)     # rows of the [rows, 1024] fp32 product between collectives: 0 .. 16 MiB
DISPATCH_SEQS = 16                    # the decode step whose work rank 0 sends in the dispatch probe


def _call(group, op: str, x):
    """One collective ``op`` on ``x`` as the engine's layers call it."""
    if op == "all_reduce":
        return group.all_reduce_(x)
    share = x.shape[0] // group.world_size
    return group.all_to_all(x, [share] * group.world_size, [share] * group.world_size, max_rows=x.shape[0])


def _operand(op: str, size: int, device: str):
    """The fp32 tensor of one sample: ``size`` elements (all-reduce) or ``[size, hidden]`` rows."""
    import torch
    shape = (size,) if op == "all_reduce" else (size, ALL_TO_ALL_HIDDEN)
    return torch.ones(shape, dtype=torch.float32, device=device)


def _run(group, op: str, sizes: list[int], repeats: int, device: str) -> list[tuple[int, float]]:
    """Every rank: two warm-up calls then ``repeats`` timed ones per size; (bytes this rank
    passes in, best seconds). CPU ranks time with their share of the host's cores as torch
    threads (``cores // ranks``, as ranks that share a host run): with more, a large copy's
    threads wait for a core another rank spins on, and a call takes a scheduler tick (~20 ms)."""
    import torch
    threads = torch.get_num_threads()
    if device == "cpu":
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // group.world_size))
    try:
        return [_time_size(group, op, size, repeats, device) for size in sizes]
    finally:
        torch.set_num_threads(threads)


def _run_skew(group, rows_list: list[int], repeats: int) -> dict:
    """Every rank: per entry of ``rows_list``, ``repeats`` x (a [rows, 1024] fp32 matrix-vector
    product, then a one-row all-reduce), then ``repeats`` x a decode step's two commands as
    the engine sends them (its ``ForwardWork``, then the rows to project), each followed by an
    all-reduce. Rank 0 returns ``segments`` (``_segment_spread``'s rows) and ``dispatch_s`` (its
    waits at the all-reduces after the commands, per step)."""
    import torch

    from kvserve.engine.step import ForwardWork
    threads = torch.get_num_threads()
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // group.world_size))
    operand = torch.zeros(ALL_TO_ALL_HIDDEN)
    gc.collect()                  # as an engine's ranks run: the collector's pauses (a full pass over a
    gc.disable()                  # big heap stalls the others) are not the ranks' jitter (startup_gc.py)
    try:
        segments = _segment_spread(group, rows_list, repeats, operand)
        work = ("forward", [ForwardWork([7], 200, list(range(13)), True) for _ in range(DISPATCH_SEQS)])
        rows = ("project", list(range(DISPATCH_SEQS)))
        before = group.skew.snapshot()
        for _ in range(repeats):
            for command in (work, rows):
                group.broadcast_object(command if group.rank == 0 else None)
                group.all_reduce_(operand)
        added = group.skew.since(before)
    finally:
        gc.enable()
        torch.set_num_threads(threads)
    return {"segments": segments, "dispatch_s": added.wait_first_s / repeats}


def _segment_spread(group, rows_list: list[int], repeats: int, operand) -> list[list[float]]:
    """Per entry of ``rows_list``: [mean seconds of a [rows, 1024] matrix-vector product, mean
    spread of the all-reduce after it, mean seconds rank 0 spent in that all-reduce besides
    waiting for the other ranks], over ``repeats`` rounds that take every size in turn (so a
    burst of noise from elsewhere on the host falls on all sizes alike), after two warm-up
    rounds. The last figure grows with the rows: the product streams the mapping's cache lines
    out, as a layer's weights do in the engine."""
    import torch
    vector = torch.rand(1024)
    matrices = [torch.rand(rows, 1024) for rows in rows_list]
    sums = [[0.0, 0.0, 0.0] for _ in rows_list]             # compute, spread, all-reduce less wait
    for i in range(repeats + 2):
        for weights, total in zip(matrices, sums):
            started = time.perf_counter()
            torch.mv(weights, vector)
            compute = time.perf_counter() - started
            before, comm = group.skew.snapshot(), group.comm_seconds
            group.all_reduce_(operand)
            added = group.skew.since(before)
            if i >= 2:
                for k, value in enumerate((compute, added.spread_s, group.comm_seconds - comm - added.wait_s)):
                    total[k] += value
    return [[value / repeats for value in total] for total in sums]


def _time_size(group, op: str, size: int, repeats: int, device: str) -> tuple[int, float]:
    """(bytes passed in, the best of ``repeats`` timed calls after two warm-ups) for one size."""
    import torch
    x = _operand(op, size, device)
    best = float("inf")
    for i in range(repeats + 2):
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        started = time.perf_counter()
        _call(group, op, x)
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        if i >= 2:
            best = min(best, time.perf_counter() - started)
    return x.numel() * 4, best


def measure(op: str, world_size: int, sizes: tuple[int, ...], repeats: int = 20,
            device: str = "cpu") -> list[tuple[int, float]]:
    """(bytes, seconds) of one ``op`` (``all_reduce`` or ``all_to_all``) among ``world_size``
    local ranks, per size."""
    from kvserve.parallel.group import RankGroup, open_store
    if world_size < 2:
        raise ValueError("a collective needs at least two ranks")
    if op not in ("all_reduce", "all_to_all", "skew"):
        raise ValueError(f"unknown collective {op!r}")
    store, path = open_store(world_size)
    plan = json.dumps({"op": op, "sizes": list(sizes), "repeats": repeats, "device": device})
    workers = [subprocess.Popen([sys.executable, "-m", "kvserve.parallel.collective_bench", str(rank),
                                 str(world_size), path, plan]) for rank in range(1, world_size)]
    try:
        group = RankGroup(store, 0, world_size, device)
        samples = (_run_skew(group, list(sizes), repeats) if op == "skew" else
                   _run(group, op, list(sizes), repeats, "cuda:0" if device == "cuda" else "cpu"))
    finally:
        for proc in workers:
            proc.wait(60)
    return samples


def measure_allreduce(world_size: int, sizes: tuple[int, ...] = DEFAULT_SIZES, repeats: int = 20,
                      device: str = "cpu") -> list[tuple[int, float]]:
    """(bytes, seconds) of one all-reduce among ``world_size`` local ranks, per size."""
    return measure("all_reduce", world_size, sizes, repeats, device)


def measure_all_to_all(world_size: int, rows: tuple[int, ...] = ALL_TO_ALL_ROWS, repeats: int = 20,
                       device: str = "cpu") -> list[tuple[int, float]]:
    """(bytes each rank passes in, seconds) of one all-to-all among ``world_size`` local ranks,
    per entry of ``rows``: every rank sends ``rows`` rows of ``ALL_TO_ALL_HIDDEN`` fp32 to every
    rank, itself included (``rows x world_size`` rows in)."""
    return measure("all_to_all", world_size, tuple(r * world_size for r in rows), repeats, device)


def measure_skew(world_size: int, rows: tuple[int, ...] = SKEW_ROWS, repeats: int = 300) -> dict:
    """``world_size`` local CPU ranks' skew at their collectives (``_run_skew``): ``segments``
    ([seconds of compute between two collectives, mean spread per call, rank 0's seconds in the
    call less its wait]) and ``dispatch_s``."""
    return measure("skew", world_size, rows, repeats, "cpu")


def fit_skew(record: dict, world_size: int) -> tuple[float, float]:
    """(fixed seconds per call, cv) of ``spread = fixed + cv x e_n x segment`` fitted to
    ``record["segments"]`` by least squares (both at least 0)."""
    from kvserve.planner.rank_skew import expected_max_normal
    fixed, inverse_slope = _fit([row[0] for row in record["segments"]], [row[1] for row in record["segments"]])
    return fixed, 1.0 / inverse_slope / max(expected_max_normal(world_size), 1e-12)


def calibrate(op: str, world_size: int) -> dict:
    """Time ``op`` (``all_reduce`` or ``all_to_all``) among ``world_size`` local ranks (CUDA
    ranks when there are that many devices, else CPU) and fit its link: ``ranks``, ``device``,
    ``latency_s``, ``bytes_per_s`` and the ``samples`` ([bytes, seconds])."""
    import torch
    device = "cuda" if torch.cuda.is_available() and torch.cuda.device_count() >= world_size else "cpu"
    print(f"timing {op.replace('_', '-')}s among {world_size} {device} ranks ...", flush=True)
    measure_op, fit = {"all_reduce": (measure_allreduce, fit_link),
                       "all_to_all": (measure_all_to_all, fit_all_to_all)}[op]
    samples = measure_op(world_size, device=device)
    latency, link = fit(samples, world_size)
    return {"ranks": world_size, "device": device, "latency_s": latency, "bytes_per_s": link,
            "samples": [[b, s] for b, s in samples]}


def fit_link(samples: list[tuple[int, float]], world_size: int) -> tuple[float, float]:
    """(latency seconds, link bytes/s) of ``latency + 2 (n - 1) / n x bytes / link`` fitted to
    ``samples`` by least squares (latency at least 0, the link at most 1 PB/s)."""
    return _fit([2 * (world_size - 1) / world_size * b for b, _ in samples], [s for _, s in samples])


def fit_all_to_all(samples: list[tuple[int, float]], world_size: int) -> tuple[float, float]:
    """(latency seconds, link bytes/s) of ``latency + (n - 1) / n x bytes / link`` (the share of
    a rank's rows that leaves it) fitted to ``samples`` by least squares."""
    return _fit([(world_size - 1) / world_size * b for b, _ in samples], [s for _, s in samples])


def _fit(moved_bytes: list[float], seconds_taken: list[float]) -> tuple[float, float]:
    """(intercept, 1 / slope) of seconds against bytes moved; through the origin when the
    intercept would be negative."""
    moved = np.array(moved_bytes, dtype=float)
    seconds = np.array(seconds_taken, dtype=float)
    slope, intercept = np.polyfit(moved, seconds, 1)
    if intercept < 0:                          # through the origin instead
        intercept, slope = 0.0, float(moved @ seconds / (moved @ moved))
    return float(intercept), float(1.0 / max(slope, 1e-15))


def _worker(argv: list[str]) -> int:
    from kvserve.parallel.group import RankGroup, join_store
    rank, world_size, path, plan = int(argv[0]), int(argv[1]), argv[2], json.loads(argv[3])
    device = plan["device"]
    group = RankGroup(join_store(world_size, path), rank, world_size, device)
    if plan["op"] == "skew":
        _run_skew(group, plan["sizes"], plan["repeats"])
    else:
        _run(group, plan["op"], plan["sizes"], plan["repeats"], f"cuda:{rank}" if device == "cuda" else "cpu")
    return 0


if __name__ == "__main__":
    sys.exit(_worker(sys.argv[1:]))
