"""Resident memory of a process tree, read from /proc (no psutil needed).

``RssSampler(root_pid, names)`` samples the root (the server's HTTP process) and every
descendant (the engine process, found through ``/proc/PID/task/*/children``) each time,
so a restarted child is picked up. Values in MiB.
"""
from __future__ import annotations

import glob
import time


def rss_kib(pid: int) -> int | None:
    """VmRSS of ``pid`` in KiB (None when the process is gone or has no VmRSS)."""
    try:
        with open(f"/proc/{pid}/status", encoding="ascii", errors="replace") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1])
    except (OSError, ValueError):
        return None
    return None


def children(pid: int) -> list[int]:
    """Direct children of ``pid`` (every thread's ``children`` list)."""
    found: list[int] = []
    for path in glob.glob(f"/proc/{pid}/task/*/children"):
        try:
            with open(path, encoding="ascii") as f:
                found.extend(int(p) for p in f.read().split())
        except (OSError, ValueError):
            continue
    return sorted(set(found))


def descendants(pid: int) -> list[int]:
    """Every process below ``pid``, breadth first."""
    out, todo = [], [pid]
    while todo:
        kids = children(todo.pop(0))
        out.extend(kids)
        todo.extend(kids)
    return out


class RssSampler:
    """Samples the RSS of a server: the root process and its descendants.

    ``labels`` maps known pids to names (e.g. ``{http_pid: "http", engine_pid: "engine"}``);
    other descendants are summed under ``"other"``."""

    def __init__(self, root_pid: int, labels: dict[int, str] | None = None):
        self.root_pid = root_pid
        self.labels = dict(labels or {root_pid: "http"})
        self.samples: list[dict] = []

    def sample(self, t: float | None = None) -> dict:
        """One sample ``{"t", "<label>_mib"..., "other_mib", "total_mib", "num_processes"}``, kept."""
        entry: dict = {"t": time.perf_counter() if t is None else t}
        by_label: dict[str, float] = {name: 0.0 for name in self.labels.values()}
        by_label["other"] = 0.0
        pids = [self.root_pid, *descendants(self.root_pid)]
        for pid in pids:
            kib = rss_kib(pid)
            if kib is not None:
                by_label[self.labels.get(pid, "other")] += kib / 1024.0
        for name, mib in by_label.items():
            entry[f"{name}_mib"] = round(mib, 2)
        entry["total_mib"] = round(sum(by_label.values()), 2)
        entry["num_processes"] = len(pids)
        self.samples.append(entry)
        return entry
