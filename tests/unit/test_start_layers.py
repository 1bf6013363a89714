"""The cluster's replica starts by layer, as the ingress's /metrics shows them (fleetsim/start_layers.py)."""
from __future__ import annotations

import pytest

from kvserve.cluster.metrics import additive_families, render_replicas
from kvserve.coldstart.layers import split_layers
from kvserve.fleetsim.start_layers import LAYERS, parse_start_layers, replica_layers, start_spans_seen
from kvserve.server.metrics import ServerMetrics

PHASES = {"checkpoint_s": 1.5, "weights_s": 0.5, "bandwidth_s": 0.2, "kv_cache_s": 0.1, "warmup_s": 0.7}


def _replica_text(phases: dict | None, process_s: float) -> str:
    metrics = ServerMetrics()
    if phases is not None:
        metrics.start.record(phases, process_s, ready_at=1_700_000_000.5)
    return metrics.render()


def test_each_replicas_layers_come_back_from_the_ingress_text():
    text = render_replicas({"a": _replica_text(PHASES, 6.0), "b": _replica_text(None, 0.0)}, additive_families())
    layers = parse_start_layers(text)
    assert set(layers) == {"a"}                  # b's engine is not ready: no layers yet
    expected = {k.removesuffix("_s"): v for k, v in split_layers(PHASES, 6.0).items()}
    assert layers["a"] == pytest.approx(expected | {"ready_unix_s": 1_700_000_000.5})
    assert sum(layers["a"][layer] for layer in LAYERS) == pytest.approx(6.0)


def test_a_start_seen_whole_is_split_into_before_the_engine_the_engine_and_after():
    changes = [(0.0, {"RUNNING": 1, "STARTING": 1}), (3.0, {"RUNNING": 2}),     # under way before the watch
               (20.0, {"RUNNING": 2, "STARTING": 1}), (32.5, {"RUNNING": 3})]
    spans = start_spans_seen(changes)
    assert spans == [(0.0, 3.0, False), (20.0, 32.5, True)]
    clock_zero = 1_000.0                                   # the changes' clock's zero, Unix time
    seen = {"old": {"runtime": 3.0},
            "late": {"runtime": 3.0, "weights": 2.0, "warmup": 1.0, "ready_unix_s": 1_002.5},
            "new": {"runtime": 4.0, "weights": 2.0, "warmup": 1.5, "ready_unix_s": 1_031.0}}
    late, new = replica_layers(seen, {"old"}, spans, clock_zero)
    assert late == {"runtime": 3.0, "weights": 2.0, "warmup": 1.0, "engine_s": 6.0}   # not seen whole
    assert new["engine_s"] == 7.5 and new["start_s"] == 12.5
    assert new["before_engine_s"] == 3.5 and new["after_engine_s"] == 1.5            # asked 20, spawned 23.5, ready 31
    assert new["before_engine_s"] + new["engine_s"] + new["after_engine_s"] == new["start_s"]
    # as many starts as replicas or none are paired: a count that differs leaves the layers alone
    assert all("start_s" not in r for r in replica_layers(seen, set(), spans, clock_zero))
