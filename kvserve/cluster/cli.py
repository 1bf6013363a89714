"""``kvserve cluster serve`` options (no Ray import here: the command imports it when run)."""
from __future__ import annotations

from kvserve.router import POLICIES, RouterWeights


def run(args) -> int:
    try:
        from kvserve.cluster.app import run_cluster
    except ImportError as exc:
        import sys
        print(f"kvserve cluster: {exc}; install the cluster extra: pip install 'kvserve[cluster]'", file=sys.stderr)
        return 2
    return run_cluster(args)


def _weights(text: str) -> str:
    """Checks ``--router-weights`` at parse time; the router parses it again in its process."""
    import argparse
    try:
        RouterWeights.parse(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text


def register(subparsers) -> None:
    """``kvserve cluster serve``: every ``kvserve serve`` option plus the cluster's own."""
    from kvserve.server.cli import register as register_serve
    cluster = subparsers.add_parser("cluster", help="serve on many replicas (Ray Serve; pip install kvserve[cluster])")
    commands = cluster.add_subparsers(dest="cluster_command", required=True)
    register_serve(commands)
    p = commands.choices["serve"]
    p.description = "Serve N engine replicas on a local Ray Serve behind a KV-aware router."
    p.add_argument("--replicas", type=int, default=2, help="engine replicas (default 2)")
    p.add_argument("--router", default="kv_aware", choices=POLICIES, help="routing policy (default kv_aware)")
    p.add_argument("--router-weights", type=_weights, default=None, metavar="NAME=VALUE,...",
                   help="the prefix policies' cost weights in prompt tokens, e.g. 'request=16,session=0' "
                        "(prefill, queued, request, kv, session, adapter; docs/router.md)")
    p.add_argument("--replica-cpus", type=float, default=0.0,
                   help="CPUs Ray reserves per replica (default 0: threads come from --threads)")
    p.add_argument("--ray-cpus", type=int, default=None, help="CPUs the local Ray may schedule (default: all)")
    lad = p.add_argument_group("degradation ladder (docs/cluster.md)")
    lad.add_argument("--no-ladder", dest="ladder", action="store_false", help="never degrade")
    lad.add_argument("--chat-ttft-slo", type=float, default=1.0,
                     help="seconds: chat first-byte p90 at which the next rung engages (default 1.0)")
    lad.add_argument("--ladder-dwell-s", type=float, default=10.0,
                     help="seconds of pressure per rung up (down: 3x as long; default 10)")
    lad.add_argument("--batch-max-tokens", type=int, default=256, help="batch requests' cap from rung 2 (default 256)")
    lad.add_argument("--priority-tenants", default="",
                     help="comma-separated tenants still admitted at the top rung (none: the rung is skipped)")
    lad.add_argument("--fallback-model", default=None, metavar="PATH",
                     help="a smaller model for rung 4, overflow_chat: chat requests beyond the fleet's decode "
                          "slots go to it while the rung is engaged (none: the rung is skipped)")
    lad.add_argument("--fallback-replicas", type=int, default=1, help="replicas of the fallback model (default 1)")
    lad.add_argument("--fallback-kv-cache-gib", type=float, default=None,
                     help="each fallback replica's KV budget in GiB (default: --kv-cache-gib)")
    p.set_defaults(func=run)
