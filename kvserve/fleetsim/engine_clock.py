"""The cluster's engines' step clocks, read through the ingress's ``/metrics`` while a trace plays.

Every engine sums its steps' wall and CPU seconds (``engine/step_time.StepClock``:
``kvserve_engine_step_seconds_total``, ``kvserve_engine_step_cpu_seconds_total``, each replica's
series labelled ``replica=`` on the ingress). Two readings a few seconds apart give, for each
replica over the window: the share of it the engine stepped (``busy``), the share of the host
its steps got (``cpu_share``: CPU over wall; about its thread count on a quiet host) and the CPU
per step. Grouped by how many engines were busy, they say where a busy host slows the steps:
a lower CPU share (the cores shared: ``host_cpu.SharedHost``'s fluid factor) or more CPU per
step (the memory system, caches: its ``contention``). The replicas' first-token times beside the
client's give the serving path's share of a TTFT. The cluster check sets them beside the
simulated host's own record (``SharedHost(record=)``, ``simulated_by_busy``).
"""
from __future__ import annotations

import math
import re
import statistics
import threading
import time
from dataclasses import dataclass

SERIES = {"kvserve_engine_step_seconds_total": "wall_s", "kvserve_engine_step_cpu_seconds_total": "cpu_s",
          "kvserve_engine_steps_total": "steps", "kvserve_time_to_first_token_seconds_sum": "ttft_sum_s",
          "kvserve_time_to_first_token_seconds_count": "ttft_count"}
_FLEET_SERIES = re.compile(r'^(\w+)\{replica="([^"]+)"\}$')      # a fleet replica's (the fallback's: more labels)
BUSY_AT_LEAST = 0.8          # a replica busy for this share of a window counts as busy in it


@dataclass(frozen=True)
class ReplicaClock:
    """One replica's counters at one scrape: its steps' wall and CPU seconds and count, and the
    sum and count of the first tokens it timed (from its app's arrival, ``engine_client``)."""

    wall_s: float = 0.0
    cpu_s: float = 0.0
    steps: float = 0.0
    ttft_sum_s: float = 0.0
    ttft_count: float = 0.0


@dataclass(frozen=True)
class ClockReading:
    """One scrape: ``t`` (the caller's clock) and each replica's ``ReplicaClock``."""

    t: float
    replicas: dict[str, ReplicaClock]


def parse_clocks(text: str) -> dict[str, ReplicaClock]:
    """Each replica's ``ReplicaClock`` from the ingress's ``/metrics`` text (its series labelled
    ``replica=`` alone)."""
    from kvserve.server.metrics import parse_metrics
    series: dict[str, dict[str, float]] = {}
    for sample, value in parse_metrics(text).items():
        match = _FLEET_SERIES.match(sample)
        if match and match.group(1) in SERIES:
            series.setdefault(match.group(2), {})[SERIES[match.group(1)]] = value
    return {replica: ReplicaClock(**values) for replica, values in series.items()}


class ClockWatcher:
    """A thread that scrapes ``url``'s ``/metrics`` every ``period_s`` (a context manager);
    ``readings`` on the clock ``perf_counter() - t0``, and ``start_layers``: each replica's
    engine start by layer, in the order first seen (``start_layers.parse_start_layers``)."""

    def __init__(self, url: str, t0: float, period_s: float = 2.0):
        self.url, self.t0, self.period_s = url.rstrip("/"), t0, period_s
        self.readings: list[ClockReading] = []
        self.start_layers: dict[str, dict[str, float]] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="engine-clock-watcher", daemon=True)

    def __enter__(self) -> "ClockWatcher":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(timeout=30)

    def _run(self) -> None:
        import httpx

        from kvserve.fleetsim.start_layers import parse_start_layers
        with httpx.Client(timeout=10.0) as client:
            while not self._stop.is_set():
                try:
                    text = client.get(self.url + "/metrics").text
                    self.readings.append(ClockReading(time.perf_counter() - self.t0, parse_clocks(text)))
                    for replica, layers in parse_start_layers(text).items():
                        self.start_layers.setdefault(replica, layers)
                except httpx.HTTPError:
                    pass                       # a scrape lost to a replica starting: the next one
                self._stop.wait(self.period_s)


def clock_windows(readings: list[ClockReading]) -> list[dict]:
    """Per pair of consecutive readings and replica in both: ``start``, ``end``, ``replica``,
    ``busy`` (stepped share of the window), ``cpu_share`` and ``cpu_ms_per_step`` (None where
    it did not step), ``first_tokens`` it timed and their mean ``replica_ttft_s`` (None: none)."""
    windows = []
    for a, b in zip(readings, readings[1:]):
        seconds = b.t - a.t
        for replica, now in b.replicas.items():
            before = a.replicas.get(replica)
            if before is None or seconds <= 0:
                continue
            wall, cpu, steps = now.wall_s - before.wall_s, now.cpu_s - before.cpu_s, now.steps - before.steps
            firsts = now.ttft_count - before.ttft_count
            windows.append({"start": round(a.t, 2), "end": round(b.t, 2), "replica": replica,
                            "busy": round(wall / seconds, 3),
                            "cpu_share": round(cpu / wall, 3) if wall > 0 else None,
                            "cpu_ms_per_step": round(1e3 * cpu / steps, 2) if steps > 0 else None,
                            "first_tokens": int(firsts),
                            "replica_ttft_s": round((now.ttft_sum_s - before.ttft_sum_s) / firsts, 4)
                            if firsts > 0 else None})
    return windows


def _by_span(windows: list[dict]) -> dict[tuple[float, float], list[dict]]:
    """``clock_windows``' windows grouped by their ``(start, end)``: every replica's over one span."""
    spans: dict[tuple[float, float], list[dict]] = {}
    for window in windows:
        spans.setdefault((window["start"], window["end"]), []).append(window)
    return spans


def _busy(windows: list[dict], busy_at_least: float) -> list[dict]:
    """The windows whose replica stepped ``busy_at_least`` of them (and so has a CPU share)."""
    return [w for w in windows if w["busy"] >= busy_at_least and w["cpu_share"] is not None]


def quiet_spans(readings: list[ClockReading], starts: list[tuple[float, float]] = (),
                busy_at_most: float = 1.0) -> list[tuple[float, float]]:
    """The spans between consecutive readings where the replicas' busy shares summed to at most
    ``busy_at_most`` (as loaded as a probe's one engine, or less) and no replica was starting
    (``starts``: (asked, running) spans on the readings' clock)."""
    return [(start, end) for (start, end), span_windows in _by_span(clock_windows(readings)).items()
            if sum(w["busy"] for w in span_windows) <= busy_at_most and not _overlaps(start, end, starts)]


def _overlaps(start: float, end: float, starts) -> bool:
    """Whether ``(start, end)`` overlaps one of ``starts`` (a replica's (asked, running) span)."""
    return any(asked < end and start < running for asked, running in starts)


STARTING = " + a start"       # the suffix of a group whose windows (or steps) had a replica starting


def measured_by_busy(windows: list[dict], first_tokens: list[tuple[float, float]] = (),
                     busy_at_least: float = BUSY_AT_LEAST, starts: list[tuple[float, float]] = ()) -> dict[str, dict]:
    """The windows grouped by how many replicas were busy over them (``"0"``, ``"1"``, ``"2"``,
    ...; ``"1 + a start"`` where a window overlaps one of ``starts``, the (asked, running) spans
    of the replicas' starts on the readings' clock): the busy replicas' median CPU share and CPU
    ms per step; the mean first-token time the replicas timed and, from ``first_tokens`` (the
    client's (first token's time, TTFT) per request, on the readings' clock) ending in the same
    windows, the client's and its excess over the replicas' (``path_s``: the serving path's hops,
    both ways)."""
    groups: dict[str, list[tuple[tuple[float, float], list[dict]]]] = {}
    for (start, end), span_windows in _by_span(windows).items():
        key = str(len(_busy(span_windows, busy_at_least))) + (STARTING if _overlaps(start, end, starts) else "")
        groups.setdefault(key, []).append(((start, end), span_windows))
    return {n: _group_figures(members, first_tokens, busy_at_least) for n, members in sorted(groups.items())}


def _group_figures(members: list, first_tokens, busy_at_least: float) -> dict:
    busy = _busy([w for _, ws in members for w in ws], busy_at_least)
    timed = [w for _, ws in members for w in ws if w["first_tokens"]]
    replica_firsts = sum(w["first_tokens"] for w in timed)
    client = [ttft for t, ttft in first_tokens if any(start <= t < end for (start, end), _ in members)]
    figures = {"windows": len(members), "busy_windows": len(busy),
               "cpu_share": round(statistics.median(w["cpu_share"] for w in busy), 3) if busy else None,
               "cpu_ms_per_step": round(statistics.median(w["cpu_ms_per_step"] for w in busy), 2) if busy else None,
               "replica_ttft_s": round(sum(w["first_tokens"] * w["replica_ttft_s"] for w in timed) / replica_firsts, 4)
               if replica_firsts else None,
               "client_ttft_s": round(statistics.fmean(client), 4) if client else None, "first_tokens": len(client)}
    if figures["replica_ttft_s"] is not None and figures["client_ttft_s"] is not None:
        figures["path_s"] = round(figures["client_ttft_s"] - figures["replica_ttft_s"], 4)
    return figures


def simulated_by_busy(record: list[tuple[float, int, float, float, int, float]]) -> dict[str, dict]:
    """``SharedHost``'s record (each step: time, engines busy, the cores' factor, the whole
    factor, replicas starting, its time alone) grouped by engines busy (``"1 + a start"`` while a
    replica started, as ``measured_by_busy``): the CPU share a one-thread engine's steps get (1 /
    the cores' factor), the rest of the factor (memory contention), steps' mean; and the CPU ms
    per step a one-thread engine spends (its time alone times the rest of the factor), beside
    ``measured_by_busy``'s: where the measured one grows more than this, the steps did not only
    grow bigger (fuller batches, which the simulated steps carry too)."""
    groups: dict[str, list[tuple[float, float, float]]] = {}
    for _, busy, cores_factor, factor, starting, alone_s in record:
        groups.setdefault(str(busy) + (STARTING if starting else ""), []).append((cores_factor, factor, alone_s))
    return {n: {"cpu_share": round(statistics.fmean(1.0 / c for c, _, _ in rows), 3),
                "cpu_per_step_factor": round(statistics.fmean(f / c for c, f, _ in rows), 3), "steps": len(rows),
                "cpu_ms_per_step": round(1e3 * statistics.fmean(a * f / c for c, f, a in rows), 2)}
            for n, rows in sorted(groups.items())}


def trace_clocks(readings: list[ClockReading], host_record: list, measured,
                 starts: list[tuple[float, float]] = (), trace_from_s: float = 0.0) -> dict:
    """The cluster's engines' step clocks over a trace and the simulated host's steps, grouped by
    engines busy and whether a replica was starting (``starts``: the measured starts' spans;
    ``measured_by_busy``, ``simulated_by_busy``: where the busy host slows the steps); beside the
    replicas' first-token times, the client's (``measured``, the trace's log, on the readings'
    clock): the path. ``trace_from_s``: where the trace starts on the record's clock (a lead-in
    played before it, the probe, is left out as the readings leave it out)."""
    first_tokens = [(first, first - sent) for sent, first in zip(measured.arrival, measured.first_token_s)
                    if not math.isnan(first)]
    by_busy = {"measured": measured_by_busy(clock_windows(readings), first_tokens, starts=starts),
               "simulated": simulated_by_busy([step for step in host_record if step[0] >= trace_from_s])}
    return {**by_busy, "cpu_per_step_measured_over_simulated": cpu_per_step_ratios(**by_busy)}


def cpu_per_step_ratios(measured: dict[str, dict], simulated: dict[str, dict]) -> dict[str, float]:
    """Per group both sides have, the measured CPU ms per step (``measured_by_busy``: the median
    over busy windows) over the simulated (``simulated_by_busy``: the mean over steps). Steps
    grown bigger (fuller batches) grow on both sides; where the ratio grows from the ``"1"``
    group's, the busy host costs the engine CPU per step that the simulated host does not."""
    return {group: round(m["cpu_ms_per_step"] / simulated[group]["cpu_ms_per_step"], 3)
            for group, m in measured.items()
            if m.get("cpu_ms_per_step") and simulated.get(group, {}).get("cpu_ms_per_step")}


def span_clock(readings: list[ClockReading], start: float, end: float = math.inf) -> dict | None:
    """All replicas' steps between the first reading at or after ``start`` and the last at or
    before ``end``: the ``seconds`` between them, the ``steps``, the share of the span some engine
    stepped (``busy``: their wall over the seconds, summed over replicas), the ``cpu_share`` of
    the steps and their wall and CPU ms per step (None without a step); None without two readings."""
    inside = [r for r in readings if start <= r.t <= end]
    if len(inside) < 2:
        return None
    first, last = inside[0], inside[-1]

    def delta(field: str) -> float:
        return sum(getattr(now, field) - getattr(first.replicas.get(name, ReplicaClock()), field)
                   for name, now in last.replicas.items())
    seconds, wall, cpu, steps = last.t - first.t, delta("wall_s"), delta("cpu_s"), delta("steps")
    return {"seconds": round(seconds, 2), "steps": int(steps), "busy": round(wall / seconds, 3),
            "cpu_share": round(cpu / wall, 3) if wall > 0 else None,
            "wall_ms_per_step": round(1e3 * wall / steps, 2) if steps else None,
            "cpu_ms_per_step": round(1e3 * cpu / steps, 2) if steps else None}


def streamed_tokens(log, start: float, end: float) -> float:
    """The tokens ``log``'s served requests streamed in ``[start, end)`` (the log's clock): each
    request's output spread evenly from its first token to its last."""
    total = 0.0
    for first, finish, output in zip(log.first_token_s, log.finish_s, log.output):
        if math.isnan(first) or math.isnan(finish):
            continue
        if finish <= first:
            total += output if start <= first < end else 0.0
            continue
        overlap = min(end, finish) - max(start, first)
        total += output * overlap / (finish - first) if overlap > 0 else 0.0
    return total


def plane_reach(readings: list[ClockReading], log, plane, busy_at_least: float = BUSY_AT_LEAST,
                since: float = -math.inf) -> float | None:
    """The share of the serving plane's and the background's load that lands on a busy engine's
    core (``host_cpu.SharedHost``'s ``reach``), from the engine's step clock over a probe: over the
    windows (starting at ``since`` or later) where exactly one replica was busy, the wall its steps
    spent off the CPU over the core-seconds the plane (``plane``: ``host_cpu.PlaneFit``; its tokens
    from ``log``, the probe's measured log, on the readings' clock) and the background wanted
    meanwhile; None without such a window."""
    lost = exposure = 0.0
    for (start, end), windows in _by_span([w for w in clock_windows(readings) if w["start"] >= since]).items():
        busy = _busy(windows, busy_at_least)
        if len(busy) != 1 or any(w["busy"] > 0.05 for w in windows if w not in busy):
            continue
        wall = busy[0]["busy"] * (end - start)
        lost += wall * (1.0 - busy[0]["cpu_share"])
        rate = streamed_tokens(log, start, end) / (end - start)
        exposure += wall * (plane.background_cores + plane.cpu_s_per_token * rate)
    return min(1.0, max(0.0, lost / exposure)) if exposure > 0 else None


def singles_path(readings: list[ClockReading], log, singles: int) -> float | None:
    """The serving path of a probe's first ``singles`` requests (sent one at a time): their mean
    client TTFT (``log``) less the mean the replicas timed, from the first reading to the last one
    that had counted exactly those first tokens; None where no reading had (a later request's
    first token came first)."""
    if not readings or len(log.arrival) < singles:
        return None
    first = readings[0].replicas

    def counted(reading: ClockReading) -> tuple[float, float]:
        before = {name: first.get(name, ReplicaClock()) for name in reading.replicas}
        return (sum(now.ttft_count - before[name].ttft_count for name, now in reading.replicas.items()),
                sum(now.ttft_sum_s - before[name].ttft_sum_s for name, now in reading.replicas.items()))
    exact = [total for count, total in map(counted, readings) if count == singles]
    if not exact:
        return None
    client = statistics.fmean(log.first_token_s[i] - log.arrival[i] for i in range(singles))
    return client - exact[-1] / singles
