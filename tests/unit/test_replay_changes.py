"""Tier 1: reading the cluster's replica changes (``fleetsim/replay.py``): the RUNNING count's
step function and each scale-up's start window, as ``watch_replicas`` records them."""
from __future__ import annotations

import pytest

from kvserve.fleetsim.replay import running_steps, start_durations, start_windows

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
    assert start_durations(CHANGES) == pytest.approx([51.3 - 40.2, 8.0, 2.5])


def test_no_scale_up_no_start():
    assert start_windows([(0.0, {"RUNNING": 1}), (5.0, {"RUNNING": 1, "STOPPING": 1})]) == []
    assert start_durations([]) == []
