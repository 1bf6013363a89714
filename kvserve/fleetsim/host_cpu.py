"""The host's cores, shared by a local cluster's engines and its serving plane.

On one machine the cluster's engine processes and the serving plane (Ray's proxy, the ingress,
the replica actors, the client, Ray's own processes) share the cores. A busy engine running
``threads`` torch threads wants that many cores the whole time it steps; the plane wants CPU
for every token it streams. When together they want more than the host has, every process
slows by the same factor (the kernel shares the cores). With ``n`` engines busy, the plane's
``c`` core-seconds per streamed token at the engines' unslowed rate ``R`` tokens/s (which the
factor slows too), ``b`` background cores and ``C`` cores, the factor ``s`` (at least 1) solves

    s x C = n x threads + b + c x R / s.

While ``k`` replicas are starting, each is busy with ``start`` cores (a new replica's imports,
weight loading and warm-up; Ray's worker and the engine process it spawns). A start is
measured by the cores its processes got (below) while a busy engine shared the host with it,
so it does not slow by ``s`` again: it takes its ``start`` cores first (at most a fair share,
``C x k / (n x threads + k)``), and the rest is shared,

    s x (C - k x start) = n x threads + b + c x R / s.

On this check's host a start got 0.8 cores and the busy engine 0.75-0.84 (of 0.96 alone), 1.22x:
the balance above gives 1.24x; counting the start among the shared demand gave 1.16x.

``PlaneFit`` measures ``c`` and ``b`` in place (``host_fit``'s probe): ``b`` = the machine's busy
cores (``/proc/stat``) while the cluster idles, the median over short windows (``idle_readings``)
so that one burst of a Ray process does not count as background for the whole probe; ``c`` =
the machine's busy core-seconds over the probe, less the background and the engine processes'
own CPU (``/proc/PID/stat`` of every process running ``kvserve.ipc.engine_proc``), per token
the probe streamed.

``start`` is measured where the replicas start (``new_processes_cpu_s``: the core-seconds of the
processes that appeared, or took on a new command line, between two ``process_cpu`` snapshots
at the start's ends, over its seconds).

Beyond the cores, the busy engines share the memory system: each step streams the weights.
``contention`` (``host_contention.py``, measured before the check: an engine pinned to one core
timed on its CPU clock alone and beside a second engine stepping on another core) is how much
longer a step takes while another engine steps beside it. A neighbour slowed by ``s`` steps
``1 / s`` of the time, so with ``n`` engines busy each step takes ``s x (1 + (contention - 1) x
(n - 1) / s) = s + (contention - 1) x (n - 1)`` times its time alone. On this check's host it
measured 1.01-1.06. While a replica starts, each step takes ``start_contention`` times that
again (``start_contention.py``: an engine's CPU per run while an engine starts in a fresh process
beside it, over alone).

The kernel does not keep a busy engine's core free for it while another core idles: the plane's
and the background's short bursts wake on whichever core, the engine's too, and take it for their
slice. With ``reach`` ``r`` of that load landing on each busy engine's core, an engine gets
``1 - r (b + c R / s)`` of its core, so ``s = (1 + r c R) / (1 - r b)``, whenever that is more
than the balance above gives. ``r`` = 0 is a perfectly balanced host, ``1 / C`` bursts spread
evenly over the cores. It is measured in place from the engine's step clock over the probe's
stream (``engine_clock.plane_reach``): on a two-core EPYC one busy engine's steps got 0.83-0.90
of a core over a trace where the balance above gives 0.94-0.97; the probe read a reach of
0.09-0.11 there, the trace 0.21-0.27 (docs/fleet_simulator.md), so the check plays it as a
variant only. Most of that gap was the windows with a replica starting: apart from them one
busy engine got 0.94-0.98 of its core over the trace in four runs of five (0.87 in the fifth;
0.92-0.97 over the probe's stream), and 0.82 while a replica started (this model: 0.72-0.88).

``SharedHost`` is that host in the simulator: the replicas on it (``SchedulerReplica(host=)``)
say when they are busy and at what token rate, the deployment when one starts and when it
serves (``Deployment(host=)``), and each step's time is multiplied by the factor at the step's
start, and by the host's own drift then when one was metered (``host_meter.py``).
"""
from __future__ import annotations

import math
import os
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass

ENGINE_MARKER = "kvserve.ipc.engine_proc"       # the engine process's command line (server/engine_client.py)


@dataclass(frozen=True)
class CpuReading:
    """One instant's CPU counters: wall time, the machine's busy core-seconds, the engine processes'."""

    wall_s: float
    machine_busy_s: float
    engines_s: float


def machine_busy_s(stat_path: str = "/proc/stat") -> float:
    """Core-seconds the machine has spent busy (not idle, not waiting for I/O) since boot."""
    with open(stat_path) as f:
        fields = [int(x) for x in f.readline().split()[1:]]
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)
    return (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK")


def _processes():
    """(pid, command line, core-seconds used so far) of every running process."""
    tick = os.sysconf("SC_CLK_TCK")
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmdline = f.read()
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue                              # the process ended meanwhile
        yield int(pid), cmdline, (int(fields[11]) + int(fields[12])) / tick


def engines_cpu_s(marker: str = ENGINE_MARKER) -> float:
    """Core-seconds used so far by the running processes whose command line holds ``marker``."""
    return sum(cpu for _, cmdline, cpu in _processes() if marker.encode() in cmdline)


def process_cpu() -> dict[tuple[int, bytes], float]:
    """Core-seconds used so far by every running process, keyed by (pid, command line): a Ray
    worker that takes on an actor changes its command line and counts as another process."""
    return {(pid, cmdline): cpu for pid, cmdline, cpu in _processes()}


def new_processes_cpu_s(before: dict[tuple[int, bytes], float], after: dict[tuple[int, bytes], float]) -> float:
    """Core-seconds spent between two ``process_cpu`` snapshots by the processes ``after`` has and
    ``before`` lacks (a pid seen before under another command line: only what it spent since)."""
    spent_before = {pid: cpu for (pid, _), cpu in before.items()}
    return sum(max(0.0, cpu - spent_before.get(pid, 0.0)) for (pid, cmdline), cpu in after.items()
               if (pid, cmdline) not in before)


def read_cpu() -> CpuReading:
    """The counters now."""
    return CpuReading(time.perf_counter(), machine_busy_s(), engines_cpu_s())


def wait_until_quiet(max_busy_cores: float = 0.3, window_s: float = 1.0, windows: int = 3,
                     timeout_s: float = 90.0, busy_s=machine_busy_s, sleep=time.sleep) -> tuple[float, list[float]]:
    """Block until the machine's busy cores stay under ``max_busy_cores`` for ``windows``
    consecutive windows of ``window_s`` (at most ``timeout_s``): what an earlier workload left
    running (a cluster's processes winding down) would slow a measurement taken now. Returns
    the seconds waited and every window's busy cores."""
    readings: list[float] = []
    quiet, waited, last = 0, 0.0, busy_s()
    while quiet < windows and waited < timeout_s:
        sleep(window_s)
        waited += window_s
        now = busy_s()
        readings.append(round((now - last) / window_s, 3))
        quiet = quiet + 1 if readings[-1] < max_busy_cores else 0
        last = now
    return waited, readings


def idle_readings(seconds: float, windows: int) -> list[CpuReading]:
    """``windows + 1`` readings ``seconds / windows`` apart, the caller idle meanwhile."""
    readings = [read_cpu()]
    for _ in range(windows):
        time.sleep(seconds / windows)
        readings.append(read_cpu())
    return readings


@dataclass(frozen=True)
class PlaneFit:
    """The serving plane's CPU: ``background_cores`` while idle, ``cpu_s_per_token`` streamed."""

    background_cores: float
    cpu_s_per_token: float

    @classmethod
    def measure(cls, idle: Sequence[CpuReading], probe_to: CpuReading, tokens_streamed: int) -> "PlaneFit":
        """From readings taken while the cluster idled (``idle_readings``; the background is the
        median of their windows' busy cores) and at the end of a probe that followed them
        (starting at ``idle[-1]``) and streamed ``tokens_streamed`` tokens."""
        rates = [(b.machine_busy_s - a.machine_busy_s) / (b.wall_s - a.wall_s)
                 for a, b in zip(idle, idle[1:]) if b.wall_s > a.wall_s]
        background = max(0.0, statistics.median(rates)) if rates else 0.0
        probe_from = idle[-1]
        probe_wall = probe_to.wall_s - probe_from.wall_s
        plane = (probe_to.machine_busy_s - probe_from.machine_busy_s) - (probe_to.engines_s - probe_from.engines_s) \
            - background * probe_wall
        return cls(background, max(0.0, plane) / max(1, tokens_streamed))

    def as_dict(self) -> dict:
        return {"background_cores": round(self.background_cores, 4),
                "cpu_ms_per_token": round(self.cpu_s_per_token * 1e3, 3)}


class SharedHost:
    """The simulated host of a local cluster (the module docstring): ``cores``, each busy engine's
    ``engine_threads``, the serving plane's ``plane``, each starting replica's ``start_cores`` and
    ``drift`` (``host_meter.HostDrift``: the host's own slowness over time; None: steady) and
    ``contention`` (a step beside another busy engine, ``host_contention.Contention.factor``),
    ``start_contention`` (a step while a replica starts, ``start_contention.StartContention.cpu_factor``);
    ``reach``: the share of the plane's and the background's load that lands on each busy
    engine's core (the module docstring; 0: none while the cores add up); ``record``: a list each
    step's factors are appended to (``engine_clock.simulated_by_busy``)."""

    def __init__(self, cores: int, engine_threads: int, plane: PlaneFit, start_cores: float = 0.0, drift=None,
                 contention: float = 1.0, record: list | None = None, reach: float = 0.0,
                 start_contention: float = 1.0):
        self.record = record     # if a list per step: (time, engines busy, cores' factor, factor, starting, alone s)
        self.reach = min(max(0.0, reach), 0.9 / max(plane.background_cores, 1e-9), 1.0)   # 1 - r b > 0
        self.cores = cores
        self.contention = max(1.0, contention)       # a neighbour never speeds a step up
        self.start_contention = max(1.0, start_contention)
        self.drift = drift
        self.engine_threads = engine_threads
        self.plane = plane
        self.start_cores = start_cores
        self._rates: dict[str, float] = {}       # busy replica -> its unslowed streamed tokens/s
        self._starting: set[str] = set()

    def busy(self, replica: str, tokens_per_s: float) -> None:
        """``replica`` steps, streaming ``tokens_per_s`` at its unslowed step time."""
        self._rates[replica] = tokens_per_s

    def idle(self, replica: str) -> None:
        """``replica`` has nothing to step."""
        self._rates.pop(replica, None)

    def starting(self, replica: str) -> None:
        """``replica`` is starting: it loads for ``start_cores`` until ``start_ended``."""
        self._starting.add(replica)

    def start_ended(self, replica: str) -> None:
        """``replica`` serves now (or its start was cancelled)."""
        self._starting.discard(replica)

    @property
    def busy_replicas(self) -> frozenset[str]:
        """The replicas stepping now."""
        return frozenset(self._rates)

    def factor(self) -> float:
        """How much slower than alone every busy engine steps now (at least 1): the cores'
        sharing (``cores_factor``), and each busy neighbour's memory contention for the share of
        the time it runs (the module docstring)."""
        return self._with_contention(self.cores_factor())

    def _with_contention(self, s: float) -> float:
        neighbours = s + (self.contention - 1.0) * max(0, len(self._rates) - 1)   # s x (1 + (c - 1)(n - 1) / s)
        return neighbours * (self.start_contention if self._starting else 1.0)

    def cores_factor(self) -> float:
        """The cores' sharing alone (at least 1): the starting replicas take their cores first
        (``starts_take``), the busy engines, the background and the plane share the rest."""
        engines = len(self._rates) * self.engine_threads
        if not engines:
            return 1.0                          # nothing steps (the starts then take what a start takes)
        rest = self.cores - self.starts_take()
        demand = engines + self.plane.background_cores
        plane = self.plane.cpu_s_per_token * sum(self._rates.values())
        balanced = (demand + math.sqrt(demand * demand + 4 * rest * plane)) / (2 * rest)
        reached = (1.0 + self.reach * plane) / (1.0 - self.reach * self.plane.background_cores)
        return max(1.0, balanced, reached)

    def starts_take(self) -> float:
        """The cores the starting replicas take now: each the ``start_cores`` it was measured to
        get while the engines shared the rest, at most a fair share of the host among the busy
        engines' threads and the starts."""
        starts = len(self._starting)
        if not starts:
            return 0.0
        fair = self.cores * starts / (len(self._rates) * self.engine_threads + starts)
        return min(starts * self.start_cores, fair)

    def step_factor(self, now: float, alone_s: float = 0.0) -> float:
        """How much longer than its roofline a step starting at ``now`` takes: the cores' sharing
        (``factor``) times the host's drift then; ``alone_s``, the step's time alone, only goes
        into the record."""
        cores = self.cores_factor()
        factor = self._with_contention(cores)
        if self.record is not None:
            self.record.append((now, len(self._rates), cores, factor, len(self._starting), alone_s))
        return factor * (self.drift.at(now) if self.drift is not None else 1.0)
