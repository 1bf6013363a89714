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
    p.add_argument("--breaker-failures", type=int, default=3,
                   help="failures in a row that open a replica's circuit breaker (default 3)")
    p.add_argument("--breaker-open-s", type=float, default=5.0,
                   help="seconds an open breaker waits before its half-open probe (default 5)")
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
    lad.add_argument("--queue-wait-s", type=float, default=60.0,
                     help="seconds a generation request may wait at the ingress for a fleet slot (replicas x "
                          "--max-num-seqs), released interactive > chat > batch, before a 503 with Retry-After "
                          "(default 60; 0: no ingress queue, Ray Serve's FIFO)")
    lad.add_argument("--fallback-replicas", type=int, default=1, help="replicas of the fallback model (default 1)")
    lad.add_argument("--fallback-kv-cache-gib", type=float, default=None,
                     help="each fallback replica's KV budget in GiB (default: --kv-cache-gib)")
    _register_autoscale(p)
    p.set_defaults(func=run)


def _register_autoscale(p) -> None:
    """Autoscaling and residency options (docs/autoscaling.md); off by default: --replicas fixed."""
    from kvserve.cluster.capacity_source import parse_capacity
    a = p.add_argument_group("autoscaling (docs/autoscaling.md)")
    a.add_argument("--autoscale", choices=("off", "tokens", "requests"), default="off",
                   help="off: --replicas fixed (default); tokens: kvserve's token-based policy; requests: "
                        "the request-count baseline (Ray's ongoing requests / --target-ongoing-requests)")
    a.add_argument("--tier", choices=("hot", "warm", "cold"), default="hot",
                   help="residency tier: hot keeps >= 1 replica; warm and cold may scale to zero (default hot)")
    a.add_argument("--min-replicas", type=int, default=None, help="default: 1 for hot, 0 for warm and cold")
    a.add_argument("--max-replicas", type=int, default=None, help="default: --replicas")
    a.add_argument("--headroom-factor", type=float, default=1.25, help="tokens: spare capacity factor (default 1.25)")
    a.add_argument("--demand-window-s", type=float, default=10.0,
                   help="tokens: seconds of counters per demand measurement (default 10)")
    a.add_argument("--downscale-window-s", type=float, default=300.0,
                   help="seconds below target before one step down (default 300)")
    a.add_argument("--target-ongoing-requests", type=float, default=2.0, help="requests: per replica (default 2)")
    a.add_argument("--retier-window-s", type=float, default=0.0,
                   help="tokens: re-tier a warm or cold model from its measured load over windows this long: "
                        "hot (>= 1 replica) from --promote-load, back below --demote-load (default 0: off)")
    a.add_argument("--promote-load", type=float, default=0.5, help="replica-equivalents (default 0.5)")
    a.add_argument("--demote-load", type=float, default=0.25, help="replica-equivalents (default 0.25)")
    a.add_argument("--replica-capacity", type=parse_capacity, default=None, metavar="PREFILL:DECODE",
                   help="tokens: one replica's tokens/s at the SLO (default: the planner on --capacity-gpu)")
    a.add_argument("--capacity-gpu", default="local",
                   help="tokens: hardware entry for the planner's capacity (default local: `kvserve profile`'s; "
                        "without it a stated fallback)")
    a.add_argument("--capacity-prompt-tokens", default="512", help="planner workload: prompt tokens (default 512)")
    a.add_argument("--capacity-output-tokens", default="128", help="planner workload: output tokens (default 128)")
    a.add_argument("--capacity-tpot-ms", type=float, default=100.0, help="planner SLO: TPOT ms (default 100)")
    a.add_argument("--capacity-ttft-ms", type=float, default=2000.0, help="planner SLO: TTFT p99 ms (default 2000)")
    a.add_argument("--cold-start-wait-s", type=float, default=120.0,
                   help="with --autoscale: seconds a request may wait for a replica (e.g. while one starts "
                        "from zero) before a 503 with Retry-After (default 120)")
