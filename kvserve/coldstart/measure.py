"""The three layers of a replica's cold start, measured in fresh processes, with and without
each mitigation (docs/coldstart.md).

Layers, from a child's timestamps and its engine's ``start_timings``:

1. ``runtime_s``: process start and imports (interpreter, torch, kvserve) — from the
   parent's spawn (or, for a pre-started process, from the "go") to the engine build's start;
2. ``weights_s``: storage -> host memory -> unpacked tensors (``checkpoint_s``: the GGUF read
   and dequantised, or the host cache read) plus host -> device and weight packing
   (``weights_s`` of the build);
3. ``warmup_s``: what stands between loaded weights and a fast first token — the bandwidth
   probe, KV allocation, the warm-up pass when on, and what the first request costs beyond a
   steady one (kernels' first use).

Variants: ``baseline`` (none), ``weight_cache`` (a host-memory cache hit: layer 2),
``warmup`` (the pass at start: layer 3, moved off the request), ``prestarted`` (a process
that imported before the request, with both other mitigations: layer 1 off the request path).
``to_first_token_s`` is spawn (or go) to the first request's answer.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time

from kvserve.coldstart.layers import split_layers
from kvserve.coldstart.weight_cache import DEFAULT_ROOT


def run_child(spec: dict, timeout_s: float = 600.0) -> dict:
    """Spawn one measured start; returns its layers and raw timestamps."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    args = [sys.executable, "-m", "kvserve.coldstart.child", json.dumps(spec)]
    spawned = time.time()
    proc = subprocess.Popen(args, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
    if spec.get("wait_for_go"):
        line = proc.stdout.readline()
        if line.strip() != "ready":
            proc.kill()
            raise RuntimeError(f"pre-started child did not get ready: {line!r}")
        time.sleep(0.2)
        spawned = time.time()                 # the request arrives now: the runtime is already up
        proc.stdin.write("go\n")
        proc.stdin.flush()
    out, _ = proc.communicate(timeout=timeout_s)
    if proc.returncode != 0:
        raise RuntimeError(f"cold-start child failed with exit code {proc.returncode}")
    return layers(json.loads(out.strip().splitlines()[-1]), spawned)


def layers(raw: dict, spawned: float) -> dict:
    """The three layers (seconds) from one child's report."""
    t = raw["start_timings"]
    build_started = max(raw["go"], raw["imported"])
    runtime = build_started - spawned if raw["go"] == raw["imported"] else raw["go"] - spawned
    first_excess = max(0.0, raw["first_request_s"] - raw["steady_request_s"])
    split = split_layers(t)
    out = {"runtime_s": runtime, "weights_s": split["weights_s"], "warmup_s": split["warmup_s"] + first_excess,
           "to_first_token_s": raw["built"] - spawned + raw["first_request_s"],
           "detail": {**{k: v for k, v in t.items()}, "first_request_s": raw["first_request_s"],
                      "steady_request_s": raw["steady_request_s"], "first_request_excess_s": first_excess}}
    return {k: (round(v, 3) if isinstance(v, float) else {kk: round(vv, 3) for kk, vv in v.items()})
            for k, v in out.items()}


def measure_cold_start(model: str | None = None, cache_root: str = DEFAULT_ROOT, kv_cache_bytes: int = 256 * 2**20,
                       threads: int | None = None) -> dict:
    """Every variant once, in order (the cache is filled by the baseline-with-cache run first)."""
    base = {"model": model, "kv_cache_bytes": kv_cache_bytes, "threads": threads}
    result = {"model": model or "default (SmolLM2-135M-Instruct GGUF)", "variants": {}}
    result["variants"]["baseline"] = run_child(base)
    result["variants"]["weight_cache_fill"] = run_child({**base, "weight_cache_dir": cache_root})
    result["variants"]["weight_cache"] = run_child({**base, "weight_cache_dir": cache_root})
    result["variants"]["warmup"] = run_child({**base, "warmup": True})
    result["variants"]["prestarted"] = run_child({**base, "warmup": True, "weight_cache_dir": cache_root,
                                                  "wait_for_go": True})
    result["layers"] = {k: result["variants"]["baseline"][k] for k in ("runtime_s", "weights_s", "warmup_s")}
    return result
