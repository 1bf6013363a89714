"""Tier 1: the autoscaling policy's board (``cluster/policy_board.py``) outside Ray: its key,
and a write from a process not connected to Ray is a no-op, never an error (the Ray side is
``tests/cluster/test_cluster_autoscale.py``: the decision in ``/cluster/status``)."""
from __future__ import annotations

from kvserve.cluster import policy_board


def test_key_names_app_and_deployment():
    assert policy_board.key("kvserve", "engine") == b"autoscale/kvserve/engine"
    assert policy_board.key(None, "engine") == b"autoscale/default/engine"


def test_publishing_outside_ray_does_nothing():
    policy_board.publish("kvserve", "engine", {"tier": "cold", "replicas": 0})
