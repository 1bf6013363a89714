"""The host's speed over time, read by a small fixed workload running beside a local cluster.

On a shared VM the host's memory bandwidth moves by itself: one single-thread matrix-vector loop
over a matrix larger than the cache, on an idle machine, ran 162-258 passes per second over one
minute, in stretches of 10-30 s. A probe of ~15 s before a 100 s trace then reads the host at
one speed and the trace runs at others, in either direction (docs/fleet_simulator.md).

``HostMeter`` runs ``python -m kvserve.fleetsim.host_meter`` beside the cluster: every
``every_s`` it makes ``passes`` passes of a float32 matrix-vector product over ``MATRIX_MB`` (one
thread, its BLAS pinned to one thread) and prints the process's CPU seconds they took, with the
time (``time.perf_counter``, the system's monotonic clock, which the caller shares). CPU time,
not wall time: a meter preempted by the engines does not read the host as slower (the cores'
sharing is ``host_cpu.SharedHost``'s part); a host whose memory is slower does. Six passes a
second (~5 ms each here) keep ~3% of one core.

``HostDrift`` turns the readings into the host's slowness over time relative to a reference
span (the probe's: its fit already holds the host's speed then): each reading's CPU seconds over
the span's median, smoothed by a running median of ``SMOOTH`` readings, as a step function of
time (``at``; before the first reading or after the last, the nearest). ``SharedHost(drift=)``
multiplies every simulated step by it. The meter reads our engines' memory traffic with the
host's, so a cluster with two engines busy reads slower than its probe with one: ``median_over``
the spans where the cluster was as quiet as its probe gives the host's own move between the
probe and the trace, one factor (``step``, from the trace's start; the cluster check's
``host_drift_quiet``).
"""
from __future__ import annotations

import argparse
import bisect
import os
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass

MATRIX_MB = 128         # well past the last-level cache: every pass streams from memory
SMOOTH = 3              # readings in the running median


def meter_loop(every_s: float, passes: int, out=sys.stdout, until=lambda: False) -> None:
    """Print ``perf_counter cpu_seconds`` every ``every_s`` for ``passes`` passes over the
    matrix, until ``until()`` (or the process is stopped)."""
    import numpy as np
    rows = 4096
    matrix = np.ones((rows, MATRIX_MB * 2**20 // (4 * rows)), dtype=np.float32)
    vector = np.ones(matrix.shape[1], dtype=np.float32)
    matrix @ vector                                   # pages touched before the first reading
    while not until():
        started = time.process_time()
        for _ in range(passes):
            matrix @ vector
        print(f"{time.perf_counter():.4f} {time.process_time() - started:.6f}", file=out, flush=True)
        time.sleep(every_s)


class HostMeter:
    """``with HostMeter() as meter: ...``; then ``meter.readings``: (perf_counter, CPU seconds of
    one reading's passes), in time order."""

    def __init__(self, every_s: float = 1.0, passes: int = 6):
        self.every_s, self.passes = every_s, passes
        self.readings: list[tuple[float, float]] = []
        self._process: subprocess.Popen | None = None

    def __enter__(self) -> "HostMeter":
        env = {**os.environ, "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
        self._process = subprocess.Popen(
            [sys.executable, "-m", "kvserve.fleetsim.host_meter", "--every", str(self.every_s),
             "--passes", str(self.passes)], stdout=subprocess.PIPE, text=True, env=env)
        return self

    def __exit__(self, *exc) -> None:
        process, self._process = self._process, None
        process.terminate()
        out, _ = process.communicate(timeout=30)
        self.readings = [(float(t), float(cpu)) for t, cpu in (line.split() for line in out.splitlines())
                         if float(cpu) > 0]


@dataclass(frozen=True)
class HostDrift:
    """The host's slowness over time, relative to a reference span (the module docstring):
    ``times`` (seconds on the caller's clock) and ``factors``, a step function."""

    times: tuple[float, ...]
    factors: tuple[float, ...]

    @classmethod
    def from_readings(cls, readings: list[tuple[float, float]], reference: tuple[float, float],
                      origin: float = 0.0) -> "HostDrift":
        """From ``HostMeter.readings``, relative to the median over ``reference`` (a span of
        perf_counter times; the whole series if it holds no reading), on a clock starting at
        ``origin``."""
        ref = [cpu for t, cpu in readings if reference[0] <= t <= reference[1]] or [cpu for _, cpu in readings]
        if not ref:
            return cls((0.0,), (1.0,))
        base = statistics.median(ref)
        cpus = [cpu for _, cpu in readings]
        first = [min(max(0, i - SMOOTH // 2), max(0, len(cpus) - SMOOTH)) for i in range(len(cpus))]
        smoothed = [statistics.median(cpus[lo:lo + SMOOTH]) for lo in first]      # whole windows at the ends
        return cls(tuple(t - origin for t, _ in readings), tuple(c / base for c in smoothed))

    def at(self, t: float) -> float:
        """The factor in effect at ``t`` (the last reading at or before it; the first before any)."""
        return self.factors[max(0, bisect.bisect_right(self.times, t) - 1)]

    def shifted(self, by_s: float) -> "HostDrift":
        """The same drift on a clock that starts ``by_s`` later."""
        return HostDrift(tuple(t - by_s for t in self.times), self.factors)

    def median_over(self, spans: list[tuple[float, float]]) -> tuple[float, int] | None:
        """The median factor of the readings taken inside ``spans`` (on this drift's clock) and
        their count; None where none was."""
        inside = [f for t, f in zip(self.times, self.factors) if any(a <= t < b for a, b in spans)]
        return (statistics.median(inside), len(inside)) if inside else None

    @classmethod
    def step(cls, factor: float, from_s: float = 0.0) -> "HostDrift":
        """A host at the reference's speed until ``from_s``, ``factor`` times slower from then on."""
        return cls((0.0, from_s), (1.0, factor))

    def summary(self) -> dict:
        """The factors' spread: min, median, max (JSON-ready)."""
        return {"readings": len(self.factors), "min": round(min(self.factors), 3),
                "median": round(statistics.median(self.factors), 3), "max": round(max(self.factors), 3)}


def main() -> None:
    parser = argparse.ArgumentParser(description="Print the CPU seconds of a fixed memory-bound workload over time")
    parser.add_argument("--every", type=float, default=1.0)
    parser.add_argument("--passes", type=int, default=6)
    args = parser.parse_args()
    try:
        meter_loop(args.every, args.passes)
    except (KeyboardInterrupt, BrokenPipeError):
        pass


if __name__ == "__main__":
    main()
