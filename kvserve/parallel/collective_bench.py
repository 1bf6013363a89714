"""The all-reduce of the engine's tensor-parallel layers, timed on this host (``kvserve profile
--tensor-parallel N``), and the planner's link model fitted to it.

Rank 0 (this process) and ranks 1..N-1 (fresh interpreters, as a replica's ranks are) join a
``RankGroup`` and all-reduce fp32 tensors of several sizes through ``RankGroup.all_reduce_``,
the call the row-parallel layers make (shared memory between CPU ranks, NCCL on CUDA). Rank 0
keeps the best of the repeats per size. ``fit_link`` fits the planner's model of one
all-reduce (``planner/roofline.allreduce_s``): ``latency + 2 (n - 1) / n x bytes / link``, by
least squares on the samples.

    python -m kvserve.parallel.collective_bench RANK WORLD STORE_PATH PLAN_JSON   (a worker rank)
"""
from __future__ import annotations

import json
import subprocess
import sys
import time

import numpy as np

DEFAULT_SIZES = (2**10, 2**12, 2**14, 2**16, 2**18, 2**20)   # fp32 elements: 4 KiB .. 4 MiB


def _run(group, sizes: list[int], repeats: int, device: str) -> list[tuple[int, float]]:
    """Every rank: two warm-up all-reduces then ``repeats`` timed ones per size; (bytes, best s)."""
    import torch
    out = []
    for numel in sizes:
        x = torch.ones(numel, dtype=torch.float32, device=device)
        best = float("inf")
        for i in range(repeats + 2):
            if device.startswith("cuda"):
                torch.cuda.synchronize()
            started = time.perf_counter()
            group.all_reduce_(x)
            if device.startswith("cuda"):
                torch.cuda.synchronize()
            if i >= 2:
                best = min(best, time.perf_counter() - started)
        out.append((numel * 4, best))
    return out


def measure_allreduce(world_size: int, sizes: tuple[int, ...] = DEFAULT_SIZES, repeats: int = 20,
                      device: str = "cpu") -> list[tuple[int, float]]:
    """(bytes, seconds) of one all-reduce among ``world_size`` local ranks, per size."""
    from kvserve.parallel.group import RankGroup, open_store
    if world_size < 2:
        raise ValueError("an all-reduce needs at least two ranks")
    store, path = open_store(world_size)
    plan = json.dumps({"sizes": list(sizes), "repeats": repeats, "device": device})
    workers = [subprocess.Popen([sys.executable, "-m", "kvserve.parallel.collective_bench", str(rank),
                                 str(world_size), path, plan]) for rank in range(1, world_size)]
    try:
        group = RankGroup(store, 0, world_size, device)
        samples = _run(group, list(sizes), repeats, "cuda:0" if device == "cuda" else "cpu")
    finally:
        for proc in workers:
            proc.wait(60)
    return samples


def fit_link(samples: list[tuple[int, float]], world_size: int) -> tuple[float, float]:
    """(latency seconds, link bytes/s) of ``latency + 2 (n - 1) / n x bytes / link`` fitted to
    ``samples`` by least squares (latency at least 0, the link at most 1 PB/s)."""
    moved = np.array([2 * (world_size - 1) / world_size * b for b, _ in samples], dtype=float)
    seconds = np.array([s for _, s in samples], dtype=float)
    slope, intercept = np.polyfit(moved, seconds, 1)
    if intercept < 0:                          # through the origin instead
        intercept, slope = 0.0, float(moved @ seconds / (moved @ moved))
    return float(intercept), float(1.0 / max(slope, 1e-15))


def _worker(argv: list[str]) -> int:
    from kvserve.parallel.group import RankGroup, join_store
    rank, world_size, path, plan = int(argv[0]), int(argv[1]), argv[2], json.loads(argv[3])
    device = plan["device"]
    group = RankGroup(join_store(world_size, path), rank, world_size, device)
    _run(group, plan["sizes"], plan["repeats"], f"cuda:{rank}" if device == "cuda" else "cpu")
    return 0


if __name__ == "__main__":
    sys.exit(_worker(sys.argv[1:]))
