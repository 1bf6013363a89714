"""A measured step-time model: ``seconds = a + b * tokens``, least squares over recent steps.

Pure Python. The speculative controller uses it to price lookahead tokens; the SLO
scheduling policy uses it to choose the per-step token budget that keeps a TPOT target.
"""
from __future__ import annotations

import time
from collections import deque


class LinearTimeModel:
    """Least-squares ``seconds = a + b * x`` over the most recent observations."""

    def __init__(self, window: int = 512):
        self._points: deque[tuple[float, float]] = deque(maxlen=window)

    def observe(self, x: float, seconds: float) -> None:
        self._points.append((float(x), float(seconds)))

    @property
    def num_points(self) -> int:
        return len(self._points)

    def coefficients(self) -> tuple[float, float] | None:
        """``(a, b)`` clamped to >= 0, or None until two distinct ``x`` were seen."""
        n = len(self._points)
        if n < 2:
            return None
        mean_x = sum(p[0] for p in self._points) / n
        mean_y = sum(p[1] for p in self._points) / n
        var_x = sum((p[0] - mean_x) ** 2 for p in self._points)
        if var_x <= 0.0:
            return None
        b = sum((p[0] - mean_x) * (p[1] - mean_y) for p in self._points) / var_x
        b = max(b, 0.0)
        return max(mean_y - b * mean_x, 0.0), b


class StepClock:
    """The wall and CPU seconds the engine's steps took, summed (a context manager around each
    step). CPU is the process's (``time.process_time``: every thread, torch's included), so
    ``cpu_s / wall_s`` is the share of the host the steps got: about the torch thread count on
    a quiet host, less where other processes take the cores (a cluster's neighbours)."""

    def __init__(self):
        self.wall_s = 0.0
        self.cpu_s = 0.0
        self._wall_at = self._cpu_at = 0.0

    def __enter__(self) -> "StepClock":
        self._wall_at, self._cpu_at = time.perf_counter(), time.process_time()
        return self

    def __exit__(self, *exc) -> None:
        self.cpu_s += time.process_time() - self._cpu_at
        self.wall_s += time.perf_counter() - self._wall_at
