"""A computed figure and the line of arithmetic that produced it.

Every number the planner reports is a :class:`Figure`: its value, its unit and
the arithmetic written out with the operands, so a reader can redo it by hand.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

GiB = 2**30
MiB = 2**20
HOURS_PER_MONTH = 730.0   # 8,760 hours a year / 12


@dataclass(frozen=True)
class Figure:
    """``value`` in ``unit``; ``arithmetic`` shows how it was computed."""

    name: str
    value: float
    unit: str
    arithmetic: str

    def __float__(self) -> float:
        return float(self.value)


def fmt_bytes(num_bytes: float) -> str:
    """Human bytes with binary prefixes: ``1.5 GiB``, ``320 KiB``, ``512 B``."""
    if not math.isfinite(num_bytes):
        return str(num_bytes)
    for unit, scale in (("TiB", 2**40), ("GiB", GiB), ("MiB", MiB), ("KiB", 2**10)):
        if abs(num_bytes) >= scale:
            return f"{num_bytes / scale:,.2f} {unit}"
    return f"{num_bytes:,.0f} B"


def fmt_num(value: float) -> str:
    """Short number: integers with thousands separators, others with 4 significant digits."""
    if not math.isfinite(value):
        return str(value)
    if float(value).is_integer() and abs(value) < 1e15:
        return f"{int(value):,}"
    return f"{value:,.4g}"


def fmt_rate(value: float, unit: str) -> str:
    """``3.35 TB/s``-style decimal prefixes for rates (bandwidth, FLOP/s)."""
    for prefix, scale in (("P", 1e15), ("T", 1e12), ("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(value) >= scale:
            return f"{value / scale:,.3g} {prefix}{unit}"
    return f"{value:,.3g} {unit}"


def fmt_seconds(seconds: float) -> str:
    """``12.3 ms`` / ``1.25 s`` / ``45 us``."""
    if not math.isfinite(seconds):
        return str(seconds)
    if abs(seconds) >= 1:
        return f"{seconds:,.3g} s"
    if abs(seconds) >= 1e-3:
        return f"{seconds * 1e3:.3g} ms"
    return f"{seconds * 1e6:.3g} us"


def find_figure(figures, name: str) -> Figure:
    """The figure called ``name`` among ``figures`` (KeyError if none)."""
    for f in figures:
        if f.name == name:
            return f
    raise KeyError(name)
