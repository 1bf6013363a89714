"""The CPU's compute dtype for ``dtype="auto"``: fp32 unless this CPU has native bf16
(``avx512_bf16`` or ``amx_bf16`` in /proc/cpuinfo) *and* a quick one-thread bf16 product
measures faster than fp32. Without those flags torch emulates bf16 (slower than fp32 and
less exact), so nothing is measured. ``engine.config.resolve`` calls ``pick_cpu_dtype()``
once, before any component is built; the reason it returns is logged at start.

The decision (``choose_cpu_dtype``) takes the flags and a measuring function, so it is
checked without touching the CPU; torch is imported only by the measurement.
"""
from __future__ import annotations

import time
from typing import Callable, Iterable

CPUINFO_PATH = "/proc/cpuinfo"
BF16_FLAGS = ("avx512_bf16", "amx_bf16")
VECTOR_FLAGS = ("amx_bf16", "avx512_bf16", "avx512f", "avx2", "avx", "asimd")  # widest first
# The measured product: a short batch through a SmolLM2-135M-sized wide projection.
MEASURE_ROWS, MEASURE_IN, MEASURE_OUT = 16, 576, 3072


def read_cpu_flags(path: str = CPUINFO_PATH) -> frozenset[str]:
    """The feature flags of the first CPU listed in a cpuinfo file (x86 ``flags``, Arm
    ``Features``); empty if the file cannot be read or lists none."""
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            for line in f:
                key, sep, value = line.partition(":")
                if sep and key.strip() in ("flags", "Features"):
                    return frozenset(value.split())
    except OSError:
        pass
    return frozenset()


def describe_isa(flags: Iterable[str]) -> str:
    """The widest vector flag found (e.g. "avx2"), or "no avx"."""
    flags = frozenset(flags)
    return next((f for f in VECTOR_FLAGS if f in flags), "no avx")


def measure_gflops(dtype_name: str, repeats: int = 5) -> float:
    """GFLOP/s of ``[16, 576] @ [576, 3072]`` (``F.linear``, the bf16 projection's op) in
    ``dtype_name`` on one thread: best of ``repeats`` after one warm-up (~1-10 ms each).
    The caller's thread count is restored."""
    import torch
    import torch.nn.functional as F

    dtype = getattr(torch, dtype_name)
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(MEASURE_ROWS, MEASURE_IN, generator=gen).to(dtype)     # [rows, in]
    w = torch.randn(MEASURE_OUT, MEASURE_IN, generator=gen).to(dtype)      # [out, in]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        best = float("inf")
        for i in range(repeats + 1):
            start = time.perf_counter()
            F.linear(x, w)
            if i:                                  # the first run is the warm-up
                best = min(best, time.perf_counter() - start)
    finally:
        torch.set_num_threads(threads)
    return 2 * MEASURE_ROWS * MEASURE_IN * MEASURE_OUT / best / 1e9


def choose_cpu_dtype(flags: Iterable[str], measure: Callable[[str], float]) -> tuple[str, str]:
    """(dtype name, reason). Without a native bf16 flag: fp32, ``measure`` never called.
    With one: ``measure("float32")`` and ``measure("bfloat16")`` (GFLOP/s) and the faster
    wins (fp32 on a tie)."""
    flags = frozenset(flags)
    isa = describe_isa(flags)
    native = [f for f in BF16_FLAGS if f in flags]
    if not native:
        return "float32", f"auto: fp32 — this CPU ({isa}, no avx512_bf16/amx_bf16) would emulate bf16"
    fp32, bf16 = measure("float32"), measure("bfloat16")
    shape = f"1 thread, {MEASURE_ROWS}x{MEASURE_IN} @ {MEASURE_IN}x{MEASURE_OUT}"
    figures = f"bf16 {bf16:.1f} vs fp32 {fp32:.1f} GFLOP/s ({shape}; CPU has {', '.join(native)})"
    if bf16 > fp32:
        return "bfloat16", f"auto: bf16 — measured faster: {figures}"
    return "float32", f"auto: fp32 — bf16 not faster: {figures}"


def pick_cpu_dtype(cpuinfo_path: str = CPUINFO_PATH) -> tuple[str, str]:
    """The picker ``engine.config.resolve`` takes: this machine's flags, measured if needed."""
    return choose_cpu_dtype(read_cpu_flags(cpuinfo_path), measure_gflops)
