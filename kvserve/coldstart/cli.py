"""``kvserve coldstart``: the three layers of a cold start for one model, with and without
each mitigation (docs/coldstart.md)."""
from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile


def register(subparsers) -> None:
    p = subparsers.add_parser("coldstart", help="measure a replica's cold start in layers (runtime, weights, "
                                                "warm-up) and what each mitigation saves")
    p.add_argument("model", nargs="?", default=None, help="GGUF file or HF folder (default: the default model)")
    p.add_argument("--weight-cache", default=None, metavar="DIR",
                   help="host-memory weight cache folder (default: a fresh one on /dev/shm, removed after; "
                        "a folder that already holds the model makes the fill run a hit)")
    p.add_argument("--kv-cache-gib", type=float, default=0.25)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from kvserve.coldstart.measure import measure_cold_start
    from kvserve.coldstart.weight_cache import DEFAULT_ROOT
    root = args.weight_cache or tempfile.mkdtemp(prefix="kvserve-coldstart-", dir=os.path.dirname(DEFAULT_ROOT))
    try:
        result = measure_cold_start(args.model, root, int(args.kv_cache_gib * 2**30), args.threads)
    finally:
        if args.weight_cache is None:
            shutil.rmtree(root, ignore_errors=True)
    if args.json:
        print(json.dumps(result))
        return 0
    print(f"cold start of {result['model']} (seconds)")
    print(f"{'variant':<18}{'runtime':>9}{'weights':>9}{'warm-up':>9}{'first token':>13}")
    for name, v in result["variants"].items():
        print(f"{name:<18}{v['runtime_s']:>9.2f}{v['weights_s']:>9.2f}{v['warmup_s']:>9.2f}{v['to_first_token_s']:>13.2f}")
    return 0
