"""How much slower an engine steps while a second engine steps beside it, on this host.

Two busy engines of a local cluster share more than the cores (``host_cpu.SharedHost``): every
decode step streams the model's weights from memory, and the host has one memory system. An
engine's CPU time per step then grows while another engine steps, whatever share of the cores
it gets. The profile times one engine alone, and the cluster's probe runs one replica, so
neither sees it.

``measure_contention`` measures it in a subprocess (``python -m kvserve.fleetsim.host_contention``)
before the cluster starts: the engine (kvserve's offline API, the replicas' thread count, pinned
to one core) runs a fixed batch (``WORKLOAD``: the check's batch and mean lengths) beside a
neighbour process (the same engine and batch in a loop, pinned to another core), in ``CYCLES``
rounds of ``runs`` runs with the neighbour stopped (``SIGSTOP``) and ``runs`` with it stepping
(``SIGCONT``). Each run is timed on the process's CPU clock, so the cores' sharing does not
count, only what slows the engine while it runs. The factor is the median beside over the
median alone; the rounds alternate because the host's speed moves by itself over half a minute
(``host_meter.py``): timed all alone first, then all beside, then alone again, the two alone
series differed by up to 9%. Where the process may run on one core only, nothing is pinned and
the two engines share it (``pinned`` says so).

On this host (AMD EPYC with AVX-512, two cores, the default model in bf16, batch 4 of 128 + 24
tokens) one engine beside another took 1.01-1.05x the CPU time per run in five probes on their
own, 0.99-1.05x in fifteen runs of the cluster check (``benchmarks/fleet_sim_cluster.py``).
"""
from __future__ import annotations

import argparse
import json
import os
import random
import select
import signal
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass

WORKLOAD = (4, 128, 24)     # requests in the batch, prompt tokens, output tokens
READY = "ready"             # the neighbour's line once its engine loaded and stepped once
CYCLES = 4                  # rounds of runs alone and beside the neighbour, in turn
MODULE = "kvserve.fleetsim.host_contention"   # run as ``python -m`` (its ``__name__`` is then ``__main__``)


@dataclass(frozen=True)
class Contention:
    """The timed runs' CPU seconds: ``alone_s`` (the neighbour stopped), ``beside_s`` (stepping),
    and whether the two were ``pinned`` to cores of their own."""

    alone_s: tuple[float, ...]
    beside_s: tuple[float, ...]
    pinned: bool

    @property
    def factor(self) -> float:
        """How much longer a run took beside the neighbour than alone (medians)."""
        return statistics.median(self.beside_s) / statistics.median(self.alone_s)

    def as_dict(self) -> dict:
        return {"factor": round(self.factor, 4), "pinned": self.pinned,
                "alone_s": [round(t, 4) for t in self.alone_s], "beside_s": [round(t, 4) for t in self.beside_s]}

    @classmethod
    def from_dict(cls, data: dict) -> "Contention":
        return cls(tuple(data["alone_s"]), tuple(data["beside_s"]), data["pinned"])


def measure_contention(runs: int = 2, threads: int = 1, workload: tuple[int, int, int] = WORKLOAD,
                       timeout_s: float = 300.0, dtype: str = "auto") -> Contention:
    """Measure in a subprocess (the module docstring), so that this process's own threads and
    core affinity stay as they were; the engines' weights in ``dtype`` (the server's ``--dtype``)."""
    return Contention.from_dict(run_probe(probe_command(MODULE, threads, workload, dtype, "--runs", str(runs)),
                                          threads, timeout_s))


def probe_command(module: str, threads: int, workload: tuple[int, int, int], dtype: str, *extra: str) -> list[str]:
    """A probe ``module``'s command line for ``threads``, ``workload`` and ``dtype``, then ``extra``."""
    return [sys.executable, "-m", module, "--threads", str(threads),
            "--workload", ",".join(map(str, workload)), "--dtype", dtype, *extra]


def run_probe(command: list[str], threads: int, timeout_s: float) -> dict:
    """Run a probe's ``command`` with ``threads`` torch threads: the JSON of its last line."""
    done = subprocess.run(command, capture_output=True, text=True, timeout=timeout_s, env=threads_env(threads))
    if done.returncode != 0:
        raise RuntimeError(f"{command[2]} failed: {done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def threads_env(threads: int) -> dict:
    """This process's environment with OpenMP's and MKL's threads set to ``threads``."""
    return {**os.environ, "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads)}


def batch_runner(threads: int, workload: tuple[int, int, int], dtype: str):
    """A function running ``workload`` once on a fresh kvserve engine, after one warm-up run."""
    from kvserve.planner.profile import open_engine, runs_kv_bytes
    batch, prompt, output = workload
    generate, facts = open_engine(None, threads, runs_kv_bytes(None, [((prompt,) * batch, output)]), dtype)
    rng, vocab = random.Random(0), facts["model"].vocab_size

    def run() -> None:
        generate([[rng.randrange(100, vocab - 100) for _ in range(prompt)] for _ in range(batch)], output)

    run()
    return run


def _cpu_seconds(run, runs: int) -> list[float]:
    times = []
    for _ in range(runs):
        started = time.process_time()
        run()
        times.append(time.process_time() - started)
    return times


def _start_neighbour(threads: int, workload: tuple[int, int, int], dtype: str, core: int | None,
                     timeout_s: float = 120.0) -> subprocess.Popen:
    """The neighbour process, once it printed ``READY``."""
    command = probe_command(MODULE, threads, workload, dtype, "--neighbour",
                            *(["--core", str(core)] if core is not None else []))
    process = subprocess.Popen(command, stdout=subprocess.PIPE, text=True, env=threads_env(threads))
    ready, _, _ = select.select([process.stdout], [], [], timeout_s)
    if not ready or process.stdout.readline().strip() != READY:
        process.kill()
        raise RuntimeError("the contention probe's neighbour did not start")
    return process


def measure_here(runs: int, threads: int, workload: tuple[int, int, int], cycles: int = CYCLES,
                 dtype: str = "auto") -> Contention:
    """The measurement itself, in this process (``measure_contention`` runs it in a subprocess):
    ``cycles`` rounds of ``runs`` runs alone (the neighbour stopped) and ``runs`` beside it."""
    cores = sorted(os.sched_getaffinity(0))
    pinned = len(cores) >= 2
    if pinned:
        os.sched_setaffinity(0, {cores[0]})
    run = batch_runner(threads, workload, dtype)
    neighbour = _start_neighbour(threads, workload, dtype, cores[1] if pinned else None)
    alone, beside = [], []
    try:
        for _ in range(cycles):
            neighbour.send_signal(signal.SIGSTOP)
            alone += _cpu_seconds(run, runs)
            neighbour.send_signal(signal.SIGCONT)
            time.sleep(0.2)                         # the neighbour is stepping again
            beside += _cpu_seconds(run, runs)
    finally:
        neighbour.kill()
        neighbour.wait()
    return Contention(tuple(alone), tuple(beside), pinned)


def _die_with_parent() -> None:
    """Ask Linux to kill this process when its parent ends (``PR_SET_PDEATHSIG``): a neighbour
    left stopped by a measurement that was killed would hold its engine's memory forever."""
    try:
        import ctypes
        ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGKILL))      # 1: PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass                                   # not Linux: the parent check below still ends it


def neighbour_loop(threads: int, workload: tuple[int, int, int], core: int | None, dtype: str = "auto") -> None:
    """Load the engine, print ``READY``, run ``workload`` until killed or orphaned."""
    parent = os.getppid()
    _die_with_parent()
    if core is not None:
        os.sched_setaffinity(0, {core})
    run = batch_runner(threads, workload, dtype)
    print(READY, flush=True)
    while os.getppid() == parent:
        run()


def main() -> None:
    parser = argparse.ArgumentParser(description="Time an engine alone and beside a second busy engine")
    parser.add_argument("--runs", type=int, default=2, help="runs alone and beside the neighbour in each round")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--workload", default=",".join(map(str, WORKLOAD)), help="BATCH,PROMPT,OUTPUT tokens")
    parser.add_argument("--neighbour", action="store_true", help="be the neighbour: run the workload until killed")
    parser.add_argument("--core", type=int, default=None, help="the neighbour's core")
    parser.add_argument("--dtype", default="auto", help="the engines' weights (the server's --dtype)")
    args = parser.parse_args()
    import torch
    torch.set_num_threads(args.threads)
    workload = tuple(int(x) for x in args.workload.split(","))
    if args.neighbour:
        neighbour_loop(args.threads, workload, args.core, args.dtype)
    else:
        print(json.dumps(measure_here(args.runs, args.threads, workload, dtype=args.dtype).as_dict()))


if __name__ == "__main__":
    main()
