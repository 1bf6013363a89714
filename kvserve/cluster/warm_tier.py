"""``--tier warm`` in the cluster: the model's weights stay resident in host memory while it
has no replica, so a replica's start maps them instead of reading and unpacking the checkpoint
(layer 2 of a cold start skipped; docs/coldstart.md).

``prepare_warm_tier(args)``: for ``--tier warm`` the replicas get ``--weight-cache`` (default
``/dev/shm/kvserve-weights``), and the cache is filled once before the deployment starts, in a
child process (``python -m kvserve.coldstart.fill``) so the driver imports no torch.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys

DEFAULT_ROOT = "/dev/shm/kvserve-weights"   # coldstart/weight_cache.DEFAULT_ROOT (importing it loads torch)


def prepare_warm_tier(args: argparse.Namespace) -> dict | None:
    """Set the replicas' weight cache and fill it for a warm model; the fill's report, or None
    when the tier is not warm."""
    if getattr(args, "tier", "hot") != "warm":
        return None
    if args.weight_cache is None:
        args.weight_cache = DEFAULT_ROOT
    command = [sys.executable, "-m", "kvserve.coldstart.fill", "--root", args.weight_cache,
               "--quantization", getattr(args, "quantization", None) or "none"]
    if args.model is not None:
        command += ["--model", args.model]
    out = subprocess.run(command, check=True, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])
