"""The engine's start-up phases (``EngineCore.start_timings``, seconds) grouped into the three
layers of a cold start (docs/coldstart.md):

    weights = checkpoint_s (storage -> host memory, or a host-cache hit) + weights_s (onto the device)
    warmup  = bandwidth_s + kv_cache_s (KV allocation) + warmup_s (the warm-up pass)
    runtime = the engine process's start to ready, minus the two above (interpreter, imports,
              building the model's modules)
"""
from __future__ import annotations

from typing import Mapping

WEIGHT_PHASES = ("checkpoint_s", "weights_s")
WARMUP_PHASES = ("bandwidth_s", "kv_cache_s", "warmup_s")


def split_layers(phases: Mapping[str, float], process_s: float | None = None) -> dict[str, float]:
    """``weights_s``, ``warmup_s`` and (when ``process_s``, spawn to ready, is known) ``runtime_s``."""
    weights = sum(phases.get(k, 0.0) for k in WEIGHT_PHASES)
    warmup = sum(phases.get(k, 0.0) for k in WARMUP_PHASES)
    out = {"weights_s": weights, "warmup_s": warmup}
    if process_s is not None:
        out["runtime_s"] = max(0.0, process_s - weights - warmup)
    return out
