"""The cluster's replica starts split by layer, read through the ingress's ``/metrics``.

A replica's start as the cluster's status sees it (STARTING to RUNNING, ``replay.start_windows``)
holds Ray Serve's part (a worker process, the replica actor's imports and server build, Ray's
readiness checks) and the engine process's three layers (runtime, weights, warm-up:
``coldstart/layers.py``), which each replica exports once its engine is ready
(``kvserve_cold_start_seconds{replica=..., layer=...}``), with the Unix time it became ready
(``kvserve_start_ready_time_seconds``). ``replica_layers`` sets them in the start: the seconds
before the engine's process was spawned, the engine's, and after it was ready until the status
said RUNNING, so a start that took twice as long says where (docs/fleet_simulator.md).
"""
from __future__ import annotations

import re

LAYERS = ("runtime", "weights", "warmup")
_LAYER_SERIES = re.compile(r'^kvserve_cold_start_seconds\{replica="([^"]+)",layer="(\w+)"\}$')
_READY_SERIES = re.compile(r'^kvserve_start_ready_time_seconds\{replica="([^"]+)"\}$')


def parse_start_layers(text: str) -> dict[str, dict[str, float]]:
    """Each fleet replica's engine start by layer (seconds) and ``ready_unix_s``, from the
    ingress's ``/metrics`` text (a replica whose engine is not ready yet has none)."""
    from kvserve.server.metrics import parse_metrics
    layers: dict[str, dict[str, float]] = {}
    for sample, value in parse_metrics(text).items():
        if match := _LAYER_SERIES.match(sample):
            layers.setdefault(match.group(1), {})[match.group(2)] = value
        elif (match := _READY_SERIES.match(sample)) and value > 0:      # 0: not set, the engine not ready
            layers.setdefault(match.group(1), {})["ready_unix_s"] = value
    return layers


def start_spans_seen(changes: list[tuple[float, dict[str, int]]]) -> list[tuple[float, float, bool]]:
    """Each scale-up's (asked, running) on the changes' clock in the order the poll saw them
    (``replay.start_windows``), and whether it was seen whole (not under way before the watch)."""
    from kvserve.fleetsim.replay import start_windows
    return [(changes[begin][0], changes[end][0], begin > 0) for begin, end in start_windows(changes)]


def replica_layers(seen: dict[str, dict[str, float]], first: set[str],
                   spans: list[tuple[float, float, bool]] = (), clock_unix_s: float | None = None) -> list[dict]:
    """The replicas started after the watch began (in ``seen``, in the order first seen, not in
    ``first``), each with its engine's layers and their sum (``engine_s``). Where there are as
    many starts in ``spans`` (``start_spans_seen``, in order), each start's seconds (``start_s``,
    seen whole) and, with the Unix time of the spans' clock's zero (``clock_unix_s``), the seconds
    from asked to the engine's spawn (``before_engine_s``: Ray's worker, the replica's imports and
    server build) and from its engine ready to RUNNING (``after_engine_s``); their sum with
    ``engine_s`` is ``start_s``."""
    started = [layers for replica, layers in seen.items() if replica not in first]
    paired = spans if len(spans) == len(started) else [None] * len(started)
    return [_placed(layers, span, clock_unix_s) for layers, span in zip(started, paired)]


def _placed(layers: dict[str, float], span: tuple[float, float, bool] | None, clock_unix_s: float | None) -> dict:
    """One replica's layers and ``engine_s``, set in its start's ``span`` (``replica_layers``)."""
    out = {k: v for k, v in layers.items() if k in LAYERS}
    out["engine_s"] = sum(out.values())
    if span is not None and span[2]:
        asked, running, _ = span
        out["start_s"] = running - asked
        if layers.get("ready_unix_s") is not None and clock_unix_s is not None:
            ready = layers["ready_unix_s"] - clock_unix_s
            out |= {"before_engine_s": ready - out["engine_s"] - asked, "after_engine_s": running - ready}
    return {k: round(v, 3) for k, v in out.items()}
