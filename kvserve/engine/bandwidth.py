"""The memory bandwidth a decode step is bound by, measured at start, and the bound
it implies: one sequence's decode step streams every weight it reads once, so it
cannot run faster than ``bytes read per step / bandwidth``."""
from __future__ import annotations

import time

import torch

PROBE_BYTES = 128 * 2**20       # past the last-level caches of the machines we run on


def measure_copy_bandwidth(device: torch.device, nbytes: int = PROBE_BYTES, repeats: int = 3) -> float:
    """Bytes/s moved by a large copy on ``device`` (read + write), best of ``repeats``,
    with the engine's thread count."""
    src = torch.ones(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    best = float("inf")
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        dst.copy_(src)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        best = min(best, time.perf_counter() - start)
    return 2 * nbytes / best


def decode_bound_text(weight_bytes: int, read_bytes: int, bandwidth: float) -> str:
    """``weights 128.3 MB, 121.0 MB read per decode step; at 11.2 GB/s -> bs=1 bound
    10.8 ms/step = 92.6 tok/s``."""
    step_s = read_bytes / bandwidth
    return (f"weights {weight_bytes / 1e6:.1f} MB, {read_bytes / 1e6:.1f} MB read per decode step; "
            f"at {bandwidth / 1e9:.1f} GB/s (measured copy) -> bs=1 bound {step_s * 1e3:.1f} ms/step "
            f"= {1 / step_s:.1f} tok/s")
