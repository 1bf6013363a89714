"""Tier 1: the engine's start-up phases grouped into the three cold-start layers."""
from __future__ import annotations

import pytest

from kvserve.coldstart.layers import split_layers


def test_phases_group_into_weights_warmup_and_the_runtime_left_over():
    phases = {"checkpoint_s": 1.5, "weights_s": 0.25, "bandwidth_s": 0.05, "kv_cache_s": 0.1, "warmup_s": 0.2}
    layers = split_layers(phases, process_s=4.0)
    assert layers == pytest.approx({"weights_s": 1.75, "warmup_s": 0.35, "runtime_s": 1.9})
    assert "runtime_s" not in split_layers(phases)
    assert split_layers({}, 0.5) == {"weights_s": 0.0, "warmup_s": 0.0, "runtime_s": 0.5}
