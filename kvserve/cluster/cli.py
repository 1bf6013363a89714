"""``kvserve cluster serve`` options (no Ray import here: the command imports it when run)."""
from __future__ import annotations

from kvserve.router import POLICIES


def run(args) -> int:
    try:
        from kvserve.cluster.app import run_cluster
    except ImportError as exc:
        import sys
        print(f"kvserve cluster: {exc}; install the cluster extra: pip install 'kvserve[cluster]'", file=sys.stderr)
        return 2
    return run_cluster(args)


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
    p.add_argument("--replica-cpus", type=float, default=0.0,
                   help="CPUs Ray reserves per replica (default 0: threads come from --threads)")
    p.add_argument("--ray-cpus", type=int, default=None, help="CPUs the local Ray may schedule (default: all)")
    p.set_defaults(func=run)
