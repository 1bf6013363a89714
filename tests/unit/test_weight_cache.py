"""Tier 1: the host-memory weight cache (round trip, keys, eviction, refusals) and the
cold-start layer arithmetic, on small in-memory checkpoints."""
from __future__ import annotations

import dataclasses
import os

import pytest
import torch

from kvserve.coldstart.measure import layers
from kvserve.coldstart.weight_cache import HostWeightCache, load_cached_checkpoint
from kvserve.config import ModelConfig, MoEConfig
from kvserve.loader.checkpoint import Checkpoint

CONFIG = ModelConfig(architecture="qwen2_moe", vocab_size=10, hidden_size=4, intermediate_size=8, num_layers=1,
                     num_heads=2, num_kv_heads=1, head_dim=2, rms_norm_eps=1e-6, rope_theta=1e4,
                     max_position_embeddings=32, eos_token_ids=(2, 3), moe=MoEConfig(4, 2, 8, mlp_only_layers=(0,)))


def checkpoint(path: str, rows: int = 10) -> Checkpoint:
    return Checkpoint(CONFIG, {"model.embed_tokens.weight": torch.arange(rows * 4.0).view(rows, 4),
                               "model.norm.weight": torch.ones(4)}, path, "hf")


def test_round_trip_keeps_tensors_and_config(tmp_path):
    source = tmp_path / "model.gguf"
    source.write_bytes(b"x" * 100)
    cache = HostWeightCache(str(tmp_path / "cache"))
    assert cache.get(str(source)) is None
    assert cache.put(checkpoint(str(source)))
    got = cache.get(str(source))
    assert got.config == CONFIG and got.config.moe.mlp_only_layers == (0,) and got.kind == "hf"
    assert torch.equal(got.tensors["model.embed_tokens.weight"], torch.arange(40.0).view(10, 4))
    assert got.path == str(source)


def test_a_changed_file_or_other_quantised_types_is_a_new_entry(tmp_path):
    source = tmp_path / "model.gguf"
    source.write_bytes(b"x" * 100)
    cache = HostWeightCache(str(tmp_path / "cache"))
    first = cache.key(str(source))
    assert cache.key(str(source), ("Q8_0",)) != first
    source.write_bytes(b"y" * 101)
    assert cache.key(str(source)) != first


def test_least_recently_used_entries_are_evicted_within_the_budget(tmp_path):
    cache = HostWeightCache(str(tmp_path / "cache"))
    paths = []
    for name in "abc":
        p = tmp_path / f"{name}.gguf"
        p.write_bytes(name.encode() * 10)
        paths.append(str(p))
    assert cache.put(checkpoint(paths[0])) and cache.put(checkpoint(paths[1]))
    cache.max_bytes = sum(size for _, size, _ in cache.entries()) + 16      # room for two entries
    os.utime(os.path.join(cache.root, cache.key(paths[0])), (1, 1))      # a: least recently used
    assert cache.put(checkpoint(paths[2]))
    assert cache.get(paths[0]) is None and cache.get(paths[1]) is not None and cache.get(paths[2]) is not None
    assert sum(size for _, size, _ in cache.entries()) <= cache.max_bytes
    assert not cache.put(checkpoint(paths[0], rows=1000))                # larger than the whole cache


def test_quantised_blocks_are_not_cached(tmp_path):
    source = tmp_path / "m.gguf"
    source.write_bytes(b"z")
    ck = dataclasses.replace(checkpoint(str(source)))
    ck.tensors["model.layers.0.mlp.down_proj.weight"] = object()          # a loader's quantised block
    assert not HostWeightCache(str(tmp_path / "cache")).put(ck)


def test_load_cached_checkpoint_misses_then_hits(tmp_path, monkeypatch):
    import kvserve.loader as loader
    source = tmp_path / "m.gguf"
    source.write_bytes(b"q")
    calls = []
    monkeypatch.setattr(loader, "load_checkpoint", lambda path, kept: calls.append(path) or checkpoint(path))
    cache = HostWeightCache(str(tmp_path / "cache"))
    first, hit1 = load_cached_checkpoint(str(source), (), cache)
    second, hit2 = load_cached_checkpoint(str(source), (), cache)
    assert (hit1, hit2) == (False, True) and calls == [str(source)]
    assert torch.equal(first.tensors["model.norm.weight"], second.tensors["model.norm.weight"])


@pytest.mark.parametrize("prestarted", [False, True])
def test_layers_from_a_child_report(prestarted):
    raw = {"started": 100.1, "imported": 101.0, "go": 105.0 if prestarted else 101.0, "built": 108.0,
           "first_request_s": 0.5, "steady_request_s": 0.2,
           "start_timings": {"checkpoint_s": 1.0, "bandwidth_s": 0.5, "weights_s": 2.0, "kv_cache_s": 0.25}}
    spawned = 105.0 if prestarted else 100.0
    out = layers(raw, spawned)
    assert out["runtime_s"] == (0.0 if prestarted else 1.0)
    assert out["weights_s"] == 3.0 and out["warmup_s"] == pytest.approx(0.5 + 0.25 + 0.3)
    assert out["to_first_token_s"] == pytest.approx(108.0 - spawned + 0.5)
