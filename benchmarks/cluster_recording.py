"""A recording of the cluster side of the fleet simulator's check (``fleet_sim_cluster.py``):
everything the simulation and the comparison read of one run, so the simulator can be played
again on it without a cluster (``fleet_sim_cluster.py --replay``).

The check's cluster side is a profile, a contention probe, a cluster, its probe and its trace:
7-8 minutes of a host that moves from one run to the next. Its simulation side is a function of
what those measured. A ``Recording`` keeps that: the hardware entry's text (the profile), the
case (phases, request shape, demand and down-scaling windows, seed, weights' dtype), the cores
the cluster ran on and the ``ClusterRun``. Replaying it gives the run's JSON again (the
simulator is deterministic: test 4 checks the replay of its last attempt against the attempt),
and a change to the simulator is judged on the same runs in seconds.

The file is a gzipped pickle of the ``Recording``, tagged with ``FORMAT``: it is read by code
whose classes (``ClusterRun`` and what it holds) kept their module paths and fields, and a
recording of another format is refused by name.
"""
from __future__ import annotations

import gzip
import os
import pickle
import tempfile
from contextlib import contextmanager
from dataclasses import dataclass

FORMAT = 1          # bump when a class a recording pickles changes its fields


class RecordingFormatError(ValueError):
    """A recording written in another format, or not a recording."""


@dataclass
class Recording:
    """One run of the check's cluster side: the hardware entry's JSON text, the case the trace
    and the probe are built from, the cores the cluster ran on and what it measured (``run``:
    ``cluster_run.ClusterRun``)."""

    hardware: str
    phases: list
    shape: object
    demand_window_s: float
    downscale_window_s: float
    seed: int
    dtype: str
    host_cores: int
    run: object

    @classmethod
    def of(cls, hw_path: str, phases, shape, demand_window_s: float, downscale_window_s: float, seed: int,
           dtype: str, host_cores: int, run) -> "Recording":
        """The recording of ``run``, measured on the hardware entry at ``hw_path``."""
        with open(hw_path) as f:
            hardware = f.read()
        return cls(hardware, [tuple(p) for p in phases], shape, demand_window_s, downscale_window_s, seed, dtype,
                   host_cores, run)

    def save(self, path: str) -> None:
        """Write it to ``path`` (a gzipped pickle tagged with ``FORMAT``)."""
        with gzip.open(path, "wb") as f:
            pickle.dump({"format": FORMAT, "recording": self}, f)

    @staticmethod
    def load(path: str) -> "Recording":
        """The recording at ``path``; ``RecordingFormatError`` if it is of another format."""
        with gzip.open(path, "rb") as f:
            saved = pickle.load(f)
        if not isinstance(saved, dict) or saved.get("format") != FORMAT:
            found = saved.get("format") if isinstance(saved, dict) else type(saved).__name__
            raise RecordingFormatError(f"{path}: a recording of format {found}, this code reads {FORMAT}")
        return saved["recording"]

    @contextmanager
    def hardware_file(self):
        """The hardware entry written to a temporary file, its path (the simulator and the
        planner read a path), removed afterwards."""
        with tempfile.TemporaryDirectory(prefix="kvserve-recording-") as folder:
            path = os.path.join(folder, "hardware.json")
            with open(path, "w") as f:
                f.write(self.hardware)
            yield path
