"""``kvserve cluster serve``: N ``EngineReplica``s on Ray Serve behind the ``Ingress``, routed
by ``KVServeRequestRouter`` (docs/cluster.md). Ray runs locally on 127.0.0.1
(``ray_runtime.py``); ``build_app`` is also the entry point for deploying on an existing
Ray cluster."""
from __future__ import annotations

import argparse
import logging
import signal
import sys
import threading

from kvserve.cluster.ray_runtime import LOOPBACK, start_local_ray, stop_local_ray  # first: pins Ray to loopback
from kvserve.cluster.ingress import Ingress
from kvserve.cluster.ladder import LadderSettings
from kvserve.cluster.replica import EngineReplica
from ray import serve  # noqa: E402  (after ray_runtime)
from ray.serve.config import RequestRouterConfig  # noqa: E402

logger = logging.getLogger("kvserve.cluster")
ROUTING_STATS_PERIOD_S = 0.5          # how often replicas report load and cached blocks to the router


def build_app(args: argparse.Namespace):
    """The Ray Serve application for these ``kvserve cluster serve`` arguments."""
    from kvserve.loader import resolve_model_path
    from kvserve.server.cli import server_keys
    from kvserve.server.tenants import load_tenants
    model_path = resolve_model_path(args.model)
    tenants = load_tenants(args.tenants) if getattr(args, "tenants", None) else None
    keys, _admin = server_keys(args, tenants)
    router = RequestRouterConfig(
        request_router_class="kvserve.cluster.ray_router:KVServeRequestRouter",
        request_router_kwargs={"policy": args.router, "weights": getattr(args, "router_weights", None)},
        request_routing_stats_period_s=ROUTING_STATS_PERIOD_S, request_routing_stats_timeout_s=5.0)
    replica = serve.deployment(EngineReplica, name="engine", num_replicas=args.replicas,
                               ray_actor_options={"num_cpus": args.replica_cpus}, request_router_config=router,
                               max_ongoing_requests=max(64, 4 * args.max_num_seqs), health_check_period_s=2.0)
    ingress = serve.deployment(Ingress, name="ingress", ray_actor_options={"num_cpus": 0},
                               max_ongoing_requests=10_000)
    return ingress.bind(replica.bind(args), model_path, keys, ladder_settings(args))


def ladder_settings(args: argparse.Namespace) -> LadderSettings | None:
    """The degradation ladder's settings from the options (None: ``--no-ladder``)."""
    if not getattr(args, "ladder", True):
        return None
    tenants = frozenset(t.strip() for t in (args.priority_tenants or "").split(",") if t.strip())
    return LadderSettings(chat_ttft_slo_s=args.chat_ttft_slo, engage_dwell_s=args.ladder_dwell_s,
                          release_dwell_s=3 * args.ladder_dwell_s, batch_max_tokens=args.batch_max_tokens,
                          priority_tenants=tenants)


def run_cluster(args: argparse.Namespace) -> int:
    """Start local Ray on 127.0.0.1, deploy, serve until SIGINT / SIGTERM."""
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    if args.host != LOOPBACK:
        print(f"kvserve cluster serve: --host must be {LOOPBACK} (the local Ray listens on loopback only)",
              file=sys.stderr)
        return 2
    node = start_local_ray(num_cpus=args.ray_cpus)
    print(f"kvserve: Ray node address {node}", file=sys.stderr, flush=True)
    serve.start(http_options={"host": args.host, "port": args.port})
    serve.run(build_app(args), name="kvserve", route_prefix="/", blocking=False)
    print(f"kvserve: {args.replicas} replicas ({args.router} routing) on http://{args.host}:{args.port}",
          file=sys.stderr, flush=True)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    stop.wait()
    serve.shutdown()
    stop_local_ray()
    return 0
