"""Tier 1: reading the cluster's replica changes (``fleetsim/replay.py``): the RUNNING count's
step function and each scale-up's start window, as ``watch_replicas`` records them."""
from __future__ import annotations

import pytest

from kvserve.fleetsim.replay import (running_steps, start_durations, start_spans, start_windows,
                                     whole_start_windows)

CHANGES = [
    (0.1, {"RUNNING": 1}),
    (40.2, {"RUNNING": 1, "PENDING_ALLOCATION": 1}),
    (41.2, {"RUNNING": 1, "STARTING": 1}),
    (51.3, {"RUNNING": 2}),
    (70.0, {"RUNNING": 2, "STOPPING": 1}),
    (71.0, {"RUNNING": 1}),
    (80.0, {"RUNNING": 1, "STARTING": 2}),
    (88.0, {"RUNNING": 2, "STARTING": 1}),      # one of two starts served, the other still starting
    (90.5, {"RUNNING": 3}),
]


def test_the_running_count_steps_only_when_it_changes():
    assert running_steps(CHANGES) == [(0.1, 1), (51.3, 2), (71.0, 1), (88.0, 2), (90.5, 3)]


def test_a_start_runs_from_the_first_pending_poll_to_the_running_count_growing():
    assert start_windows(CHANGES) == [(1, 3), (6, 7), (7, 8)]
    assert start_spans(CHANGES) == [(40.2, 51.3), (80.0, 90.5)]       # some replica starting throughout
    assert start_durations(CHANGES) == pytest.approx([51.3 - 40.2, 8.0, 2.5])


def test_a_start_under_way_at_the_first_poll_is_not_a_start_duration():
    probe_started = [(0.1, {"RUNNING": 1, "STARTING": 1}), (8.4, {"RUNNING": 2}), (25.0, {"RUNNING": 1}),
                     (40.0, {"RUNNING": 1, "STARTING": 1}), (57.5, {"RUNNING": 2})]
    assert start_windows(probe_started) == [(0, 1), (3, 4)]        # both are still spans a start ran in
    assert whole_start_windows(probe_started) == [(3, 4)]
    assert start_durations(probe_started) == pytest.approx([17.5])  # not (8.3 + 17.5) / 2 on average
    only_that_one = probe_started[:3]
    assert start_durations(only_that_one) == pytest.approx([8.3])   # none seen whole: the lower bound


def test_a_start_given_up_is_not_timed_into_the_next_one():
    """The probe's replica still starting at the trace's start, given up as the load fell (no
    RUNNING one more), then a start in the busy phase: one CI run timed that as 67.8 s from the
    first poll, and the simulator's replicas took that long to start."""
    given_up = [(0.21, {"RUNNING": 1, "STARTING": 1}), (23.51, {"RUNNING": 1}),
                (45.61, {"RUNNING": 1, "STARTING": 1}), (68.01, {"RUNNING": 2})]
    assert start_windows(given_up) == [(2, 3)]
    assert start_durations(given_up) == pytest.approx([68.01 - 45.61])
    assert start_spans(given_up) == [(0.21, 23.51), (45.61, 68.01)]    # its processes ran: not a quiet span
    stopped_while_pending = [(0.0, {"RUNNING": 1}), (5.0, {"RUNNING": 1, "PENDING_ALLOCATION": 1}),
                             (9.0, {"RUNNING": 1, "STOPPING": 1}), (20.0, {"RUNNING": 1, "STARTING": 1}),
                             (31.0, {"RUNNING": 2})]
    assert start_durations(stopped_while_pending) == pytest.approx([11.0])


def test_no_scale_up_no_start():
    assert start_windows([(0.0, {"RUNNING": 1}), (5.0, {"RUNNING": 1, "STOPPING": 1})]) == []
    assert start_durations([]) == []


def test_the_cores_a_start_took_count_only_the_starts_seen_whole():
    from kvserve.fleetsim.cluster_reads import starting_cores
    changes = [(0.1, {"RUNNING": 1, "STARTING": 1}), (8.4, {"RUNNING": 2}), (25.0, {"RUNNING": 1}),
               (40.0, {"RUNNING": 1, "STARTING": 1}), (57.5, {"RUNNING": 2})]
    worker = (11, b"ray::ServeReplica")              # the probe's replica: its processes before the watch
    snapshots = [{worker: 5.0}, {worker: 12.0}, {worker: 12.0}, {worker: 12.0},
                 {worker: 13.0, (12, b"ray::ServeReplica:b"): 4.0, (13, b"kvserve.ipc.engine_proc"): 10.0}]
    assert starting_cores(changes, snapshots) == pytest.approx(14.0 / 17.5)   # not 14 / (8.3 + 17.5)
