"""A measured step-time model: ``seconds = a + b * tokens``, least squares over recent steps.

Pure Python. The speculative controller uses it to price lookahead tokens; the SLO
scheduling policy uses it to choose the per-step token budget that keeps a TPOT target.
"""
from __future__ import annotations

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

    def seconds_for(self, tokens: float) -> float | None:
        """Predicted seconds of a step of ``tokens`` tokens (None until fitted)."""
        fit = self.coefficients()
        return None if fit is None else fit[0] + fit[1] * tokens

    def tokens_within(self, seconds: float) -> int | None:
        """Most tokens a step may hold and still take at most ``seconds`` (0 if even an
        empty step is slower; None until fitted or when time does not grow with tokens)."""
        fit = self.coefficients()
        if fit is None or fit[1] <= 0.0:
            return None
        a, b = fit
        return max(int((seconds - a) / b), 0)
