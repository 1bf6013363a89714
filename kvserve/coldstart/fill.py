"""Put a model's packed weights into the host-memory weight cache before any replica starts
(the warm residency tier: weights resident in host memory, no replica).

    python -m kvserve.coldstart.fill --model PATH --quantization none --root /dev/shm/kvserve-weights

Prints one JSON line: the model path, the cache root, whether it was already there, seconds.
"""
from __future__ import annotations

import argparse
import json
import time

from kvserve.coldstart.weight_cache import DEFAULT_ROOT, HostWeightCache, load_cached_checkpoint


def fill(model: str | None, quantization: str = "none", root: str = DEFAULT_ROOT) -> dict:
    """Load ``model`` into the cache at ``root`` (with the direct types ``quantization`` keeps)."""
    from kvserve.loader.api import resolve_model_path
    from kvserve.quant.transform import direct_types
    started = time.perf_counter()
    _checkpoint, hit = load_cached_checkpoint(model, direct_types(quantization), HostWeightCache(root))
    return {"model": resolve_model_path(model), "root": root, "already_cached": hit,
            "seconds": round(time.perf_counter() - started, 3)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--quantization", default="none")
    parser.add_argument("--root", default=DEFAULT_ROOT)
    args = parser.parse_args(argv)
    print(json.dumps(fill(args.model, args.quantization, args.root)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
