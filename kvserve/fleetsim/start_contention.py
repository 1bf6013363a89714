"""How much slower a busy engine steps while a replica starts beside it, on this host.

A replica's start (imports, the weights read and unpacked, KV allocated, a warm-up step) runs on
the same cores and the same memory system as the engines already serving. ``host_cpu.SharedHost``
models it as cores the start takes first (``start_cores``, the mean the cluster's starting
processes got); nothing there makes an engine's step cost more CPU while a start runs, and the
cores' balance gives one busy engine beside one start on two cores no slowdown at all.

``measure_start_contention`` measures both in a subprocess (``python -m
kvserve.fleetsim.start_contention``), before the cluster starts: the engine (kvserve's offline API,
the replicas' thread count, not pinned, as the cluster's engines are not) runs a fixed batch
(``host_contention.WORKLOAD``) in a loop; ``STARTS`` times, after ``runs`` runs alone, it starts
an engine in a fresh process (``--start``: the imports, ``planner.profile.open_engine`` on the
same model and dtype, one warm-up run; Ray's worker is not part of it) and keeps running the batch
until that process ends. Each run is timed on the wall clock and on the process's CPU clock;
only the runs that ended before the start did count as beside it. The start's own core-seconds
come from the kernel's accounting of the child (``os.wait4``, in a thread that notes the end).

``StartContention.cpu_factor`` is how much more CPU a run took beside a start (the caches and
the memory system: what ``SharedHost(start_contention=)`` plays while a replica starts),
``wall_factor`` how much longer it took on the wall clock, and ``start_cores`` the cores the start
got over its seconds. ``predicted_wall_factor`` is what ``SharedHost`` gives for the same host
(one busy engine, one start of ``start_cores``, no plane), with the measured ``cpu_factor`` or
without, to set beside ``wall_factor``.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import threading
import time
from dataclasses import dataclass, fields

from kvserve.fleetsim.host_contention import WORKLOAD, batch_runner, probe_command, run_probe, threads_env

STARTS = 3                  # replica starts beside the busy engine, each after runs alone
MODULE = "kvserve.fleetsim.start_contention"   # run as ``python -m``


@dataclass(frozen=True)
class StartContention:
    """The timed runs (wall and CPU seconds) ``alone`` and ``beside`` a start, and the starts'
    wall and CPU seconds (``starts_wall_s``, ``starts_cpu_s``)."""

    alone_wall_s: tuple[float, ...]
    alone_cpu_s: tuple[float, ...]
    beside_wall_s: tuple[float, ...]
    beside_cpu_s: tuple[float, ...]
    starts_wall_s: tuple[float, ...]
    starts_cpu_s: tuple[float, ...]

    @property
    def cpu_factor(self) -> float:
        """How much more CPU a run took beside a start than alone (medians; at least 1 is not
        forced: a factor under 1 is the measurement's noise)."""
        return statistics.median(self.beside_cpu_s) / statistics.median(self.alone_cpu_s)

    @property
    def wall_factor(self) -> float:
        """How much longer a run took beside a start than alone on the wall clock (medians)."""
        return statistics.median(self.beside_wall_s) / statistics.median(self.alone_wall_s)

    @property
    def start_cores(self) -> float:
        """The cores the starts got: their core-seconds over their seconds."""
        return sum(self.starts_cpu_s) / sum(self.starts_wall_s)

    def predicted_wall_factor(self, cores: int, threads: int, with_cpu_factor: bool = True) -> float:
        """``host_cpu.SharedHost``'s step factor for this host: one busy engine of ``threads``,
        one start taking ``start_cores``, no plane or background; times ``cpu_factor`` if
        ``with_cpu_factor``."""
        from kvserve.fleetsim.host_cpu import PlaneFit, SharedHost
        host = SharedHost(cores, threads, PlaneFit(0.0, 0.0), start_cores=self.start_cores,
                          start_contention=self.cpu_factor if with_cpu_factor else 1.0)
        host.busy("engine", 0.0)
        host.starting("start")
        return host.step_factor(0.0)

    def as_dict(self, cores: int | None = None, threads: int = 1) -> dict:
        """The factors and the timed runs; with ``cores``, the model's predictions beside them."""
        figures = {"cpu_factor": round(self.cpu_factor, 4), "wall_factor": round(self.wall_factor, 4),
                   "start_cores": round(self.start_cores, 4)}
        if cores is not None:
            figures["predicted_wall_factor"] = round(self.predicted_wall_factor(cores, threads), 4)
            figures["predicted_wall_factor_cores_only"] = round(
                self.predicted_wall_factor(cores, threads, with_cpu_factor=False), 4)
        return {**figures, **{f.name: [round(t, 4) for t in getattr(self, f.name)] for f in fields(self)}}

    @classmethod
    def from_dict(cls, data: dict) -> "StartContention":
        return cls(**{f.name: tuple(data[f.name]) for f in fields(cls)})


def measure_start_contention(runs: int = 2, threads: int = 1, workload: tuple[int, int, int] = WORKLOAD,
                             starts: int = STARTS, timeout_s: float = 400.0, dtype: str = "auto") -> StartContention:
    """Measure in a subprocess (the module docstring), so that this process's threads stay as
    they were; the engines' weights in ``dtype`` (the server's ``--dtype``)."""
    command = probe_command(MODULE, threads, workload, dtype, "--runs", str(runs), "--starts", str(starts))
    return StartContention.from_dict(run_probe(command, threads, timeout_s))


def _timed(run) -> tuple[float, float, float]:
    """Run once: (wall seconds, CPU seconds, the wall clock at its end)."""
    wall, cpu = time.perf_counter(), time.process_time()
    run()
    end = time.perf_counter()
    return end - wall, time.process_time() - cpu, end


def _beside_one_start(run, command: list[str], env: dict, timeout_s: float = 300.0):
    """Start ``command`` (one replica start) and run ``run`` until it ends: (the runs that ended
    before it did, as (wall, CPU) seconds; its wall seconds; its core-seconds). A thread waits
    for the process (``os.wait4``), so its end is known to the moment, not to the run."""
    started = time.perf_counter()
    process = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL)
    ended: list = []                                # (the wall clock, wait status, usage) once it ended

    def wait() -> None:
        _, status, usage = os.wait4(process.pid, 0)
        ended.append((time.perf_counter(), status, usage))

    waiter = threading.Thread(target=wait, daemon=True)
    waiter.start()
    timed = []
    while not ended:
        if time.perf_counter() - started > timeout_s:
            process.kill()
            waiter.join()
            raise RuntimeError("the replica start did not end")
        timed.append(_timed(run))
    waiter.join()
    end, status, usage = ended[0]
    process.returncode = os.waitstatus_to_exitcode(status)
    if process.returncode != 0:
        raise RuntimeError(f"the replica start failed ({process.returncode})")
    return [(w, c) for w, c, run_end in timed if run_end <= end], end - started, usage.ru_utime + usage.ru_stime


def measure_here(runs: int, threads: int, workload: tuple[int, int, int], starts: int = STARTS,
                 dtype: str = "auto") -> StartContention:
    """The measurement itself, in this process (``measure_start_contention`` runs it in a
    subprocess): ``starts`` rounds of ``runs`` runs alone and one start with runs beside it."""
    run = batch_runner(threads, workload, dtype)
    start = probe_command(MODULE, threads, workload, dtype, "--start")
    alone, beside, walls, cpus = [], [], [], []
    for _ in range(starts):
        alone += [_timed(run)[:2] for _ in range(runs)]
        timed, wall, cpu = _beside_one_start(run, start, threads_env(threads))
        beside += timed
        walls.append(wall)
        cpus.append(cpu)
    if not beside:
        raise RuntimeError("no run ended while a replica started: the workload outlasts a start")
    return StartContention(*zip(*alone), *zip(*beside), tuple(walls), tuple(cpus))


def start_once(threads: int, workload: tuple[int, int, int], dtype: str) -> None:
    """One replica start: a fresh engine of ``threads`` in ``dtype`` and one warm-up run."""
    batch_runner(threads, workload, dtype)


def main() -> None:
    parser = argparse.ArgumentParser(description="Time an engine alone and while a replica starts beside it")
    parser.add_argument("--runs", type=int, default=2, help="runs alone before each start")
    parser.add_argument("--starts", type=int, default=STARTS)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--workload", default=",".join(map(str, WORKLOAD)), help="BATCH,PROMPT,OUTPUT tokens")
    parser.add_argument("--start", action="store_true", help="be the start: load an engine, warm it up, exit")
    parser.add_argument("--dtype", default="auto", help="the engines' weights (the server's --dtype)")
    args = parser.parse_args()
    import torch
    torch.set_num_threads(args.threads)
    workload = tuple(int(x) for x in args.workload.split(","))
    if args.start:
        start_once(args.threads, workload, args.dtype)
        return
    measured = measure_here(args.runs, args.threads, workload, args.starts, args.dtype)
    print(json.dumps(measured.as_dict(len(os.sched_getaffinity(0)), args.threads)))


if __name__ == "__main__":
    main()
