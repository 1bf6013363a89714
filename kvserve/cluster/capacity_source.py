"""Where the autoscaler's per-replica capacity comes from (``kvserve cluster serve --autoscale
tokens``), in this order:

1. ``--replica-capacity PREFILL:DECODE`` (tokens/s), measured by the operator;
2. the planner (``kvserve.autoscale.replica_capacity``) on the hardware entry ``--capacity-gpu``
   (default ``local``: the one ``kvserve profile`` saved in ``~/.cache/kvserve/hardware/
   local.json``; a catalog GPU or a JSON file also work) for the served model and the workload
   of ``--capacity-prompt-tokens`` / ``--capacity-output-tokens`` at ``--capacity-tpot-ms`` /
   ``--capacity-ttft-ms``;
3. when there is no such entry (or the planner finds the SLO impossible there), the stated
   fallback ``FALLBACK``: the default model (SmolLM2-135M) on one CPU thread, from
   ``benchmarks/offline_throughput.json`` (64 requests, 32,991 prompt + 9,138 output tokens in
   76.95 s on 2 threads) with prefill assumed 10x cheaper per token than decode:
   ``428.7 / (10 c) + 118.8 / c = 1`` gives ``c`` = 161.7 decode tokens/s on 2 threads, halved
   for one thread: 80 decode and 800 prefill tokens/s. A rough figure, and the capacity says so.
"""
from __future__ import annotations

import argparse

from kvserve.autoscale import ReplicaCapacity

FALLBACK = ReplicaCapacity(
    800.0, 80.0, "fallback (no profile): default model on one CPU thread from benchmarks/offline_throughput.json "
                 "with prefill assumed 10x cheaper per token than decode; run `kvserve profile` for a measured one")


def parse_capacity(text: str) -> ReplicaCapacity:
    """``PREFILL:DECODE`` tokens/s per replica (``--replica-capacity``)."""
    try:
        prefill, decode = (float(x) for x in text.split(":", 1))
    except ValueError:
        raise argparse.ArgumentTypeError(f"--replica-capacity {text!r}: use PREFILL:DECODE tokens/s, "
                                         "e.g. 800:80") from None
    return ReplicaCapacity(prefill, decode, f"given: --replica-capacity {text}")


def _plan_argv(model: str, args: argparse.Namespace) -> list[str]:
    """``kvserve plan`` arguments for one replica of ``model`` under the capacity workload."""
    argv = ["plan", "--model", model, "--gpu", args.capacity_gpu, "--rps", "1",
            "--prompt-tokens", str(args.capacity_prompt_tokens), "--output-tokens", str(args.capacity_output_tokens),
            "--tpot-ms", str(args.capacity_tpot_ms), "--ttft-p99-ms", str(args.capacity_ttft_ms),
            "--max-num-seqs", str(args.max_num_seqs)]
    return argv


def planned_capacity(model: str, args: argparse.Namespace) -> ReplicaCapacity:
    """The planner's capacity for ``model`` on ``--capacity-gpu`` (raises the planner's
    errors: no profile, unknown model, impossible SLO)."""
    from kvserve.autoscale import replica_capacity
    from kvserve.planner.cli import build_inputs, register
    parser = argparse.ArgumentParser(prog="kvserve")
    register(parser.add_subparsers(dest="command"))
    inputs = build_inputs(parser.parse_args(_plan_argv(model, args)))
    return replica_capacity(inputs)


def resolve_capacity(model: str, args: argparse.Namespace) -> ReplicaCapacity:
    """The capacity the autoscaler uses for one replica of ``model`` (order in the module
    docstring); its ``arithmetic`` says where it came from."""
    from kvserve.errors import KVServeError
    given = getattr(args, "replica_capacity", None)
    if given is not None:
        return given
    try:
        return planned_capacity(model, args)
    except KVServeError as exc:
        reason = getattr(exc, "message", str(exc))
        return ReplicaCapacity(FALLBACK.prefill_tokens_per_s, FALLBACK.decode_tokens_per_s,
                               f"{FALLBACK.arithmetic} (planner on {args.capacity_gpu!r}: {reason})")


def settings_from_args(args: argparse.Namespace, model: str):
    """The fleet's ``AutoscaleSettings`` for ``kvserve cluster serve`` (None with ``--autoscale
    off``): bounds from ``--tier`` / ``--min-replicas`` / ``--max-replicas`` (defaults: hot 1,
    warm and cold 0; max ``--replicas``), the capacity from ``resolve_capacity``."""
    from kvserve.cluster.autoscaling import AutoscaleSettings
    mode = getattr(args, "autoscale", "off")
    if mode == "off":
        return None
    minimum = args.min_replicas if args.min_replicas is not None else (1 if args.tier == "hot" else 0)
    maximum = args.max_replicas if args.max_replicas is not None else max(args.replicas, minimum, 1)
    capacity = resolve_capacity(model, args) if mode == "tokens" else FALLBACK
    return AutoscaleSettings(mode=mode, tier=args.tier, min_replicas=minimum, max_replicas=maximum,
                             prefill_tokens_per_s=capacity.prefill_tokens_per_s,
                             decode_tokens_per_s=capacity.decode_tokens_per_s, capacity_source=capacity.arithmetic,
                             headroom_factor=args.headroom_factor, demand_window_s=args.demand_window_s,
                             downscale_window_s=args.downscale_window_s,
                             target_ongoing_requests=args.target_ongoing_requests,
                             retier_window_s=getattr(args, "retier_window_s", 0.0),
                             promote_load=getattr(args, "promote_load", 0.5),
                             demote_load=getattr(args, "demote_load", 0.25))
