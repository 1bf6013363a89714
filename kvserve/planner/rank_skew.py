"""What a tensor-parallel step loses to its ranks' skew, beside the wire.

A collective ends when the last rank arrives, so every collective of a step costs the wire
(``roofline.allreduce_s``) plus the spread of the ranks' arrivals: the slowest rank's
compute since the previous collective over the mean rank's. With each rank's segment
jittered by a fraction ``cv`` (standard deviation over the mean), the largest of n exceeds
the mean by ``cv x e_n x segment``, ``e_n`` the expected largest of n standard normals
(0.56 for 2, 1.03 for 4, 1.42 for 8); summed over a step's segments that is ``cv x e_n`` of
the step's compute. Add a fixed spread per collective, and once per forward the lag of the
workers receiving the step's work from rank 0 (``dispatch``)::

    skew = collectives x fixed + cv x e_n x compute + dispatch

``kvserve profile --tensor-parallel N`` measures the three on the host
(``parallel/collective_bench.measure_skew``: ranks' stamped arrivals); catalogue entries
carry 0 (not measured here: their ranks' jitter needs their GPUs).
"""
from __future__ import annotations

import functools
import math

from kvserve.planner.hardware import HardwareSpec

_GRID = 4001                  # points of the numerical integral over [-8, 8] standard deviations


@functools.lru_cache(maxsize=64)
def expected_max_normal(n: int) -> float:
    """E[max of ``n`` independent standard normals]; 0 for one (a pure function of ``n``,
    memoised: the integral takes ~1 ms and a simulation asks at every step)."""
    if n <= 1:
        return 0.0
    step = 16.0 / (_GRID - 1)
    total = 0.0
    for i in range(_GRID):
        z = -8.0 + i * step
        cdf = 0.5 * (1.0 + math.erf(z / math.sqrt(2.0)))
        total += z * n * cdf ** (n - 1) * math.exp(-z * z / 2.0) / math.sqrt(2.0 * math.pi)
    return total * step


def rank_skew_s(hw: HardwareSpec, ranks: int, collectives: int, compute_s: float) -> float:
    """Seconds a step of ``ranks`` ranks with ``collectives`` collectives and ``compute_s``
    seconds of compute per rank loses to the ranks' skew (module docstring)."""
    if ranks <= 1 or not (hw.rank_skew_fixed_s or hw.rank_jitter_cv or hw.dispatch_s):
        return 0.0
    return (collectives * hw.rank_skew_fixed_s + hw.rank_jitter_cv * expected_max_normal(ranks) * compute_s
            + hw.dispatch_s)
