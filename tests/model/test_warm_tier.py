"""Tier 2: ``--tier warm`` in the cluster puts the model's weights in the host cache before any
replica starts (filled in a child process, so the driver imports no torch); a replica with
``--weight-cache`` then maps them (tests/server/test_server_coldstart_metrics.py measures it)."""
from __future__ import annotations

import argparse

from kvserve.cluster.warm_tier import DEFAULT_ROOT, prepare_warm_tier
from kvserve.coldstart import weight_cache


def test_warm_tier_fills_the_host_cache_once_and_hot_leaves_everything_alone(tmp_path, model_path):
    assert DEFAULT_ROOT == weight_cache.DEFAULT_ROOT
    args = argparse.Namespace(tier="warm", weight_cache=str(tmp_path / "w"), model=None, quantization="none")
    first = prepare_warm_tier(args)
    assert first["already_cached"] is False and first["model"] == model_path
    assert weight_cache.HostWeightCache(args.weight_cache).get(model_path, ()) is not None
    assert prepare_warm_tier(args)["already_cached"] is True
    hot = argparse.Namespace(tier="hot", weight_cache=None, model=None, quantization="none")
    assert prepare_warm_tier(hot) is None and hot.weight_cache is None
