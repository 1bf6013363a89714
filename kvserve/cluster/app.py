"""``kvserve cluster serve``: N ``EngineReplica``s on Ray Serve behind the ``Ingress``, routed
by ``KVServeRequestRouter`` (docs/cluster.md), and with ``--fallback-model`` a second
``EngineReplica`` deployment of that model for the ladder's ``overflow_chat`` rung. Ray runs locally on 127.0.0.1
(``ray_runtime.py``); ``build_app`` is also the entry point for deploying on an existing
Ray cluster."""
from __future__ import annotations

import argparse
import logging
import signal
import sys
import threading

from kvserve.cluster.ray_runtime import LOOPBACK, gcs_address, logs_dir, start_local_ray, stop_local_ray  # first: pins Ray to loopback
from kvserve.cluster.admission import fleet_slots
from kvserve.cluster.ingress import Ingress
from kvserve.cluster.ladder import LadderSettings
from kvserve.cluster.overflow import FallbackTarget
from kvserve.cluster.autoscaling import AutoscaleSettings
from kvserve.cluster.ray_autoscale import autoscaling_config
from kvserve.cluster.replica import EngineReplica
from kvserve.cluster.warm_tier import prepare_warm_tier
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
    warm = prepare_warm_tier(args)              # --tier warm: weights into the host cache before any replica
    if warm is not None:
        logger.info("warm tier: %s in the host weight cache %s (%s, %.2f s)", warm["model"], warm["root"],
                    "already there" if warm["already_cached"] else "filled", warm["seconds"])
    scaling = autoscale_settings(args, model_path)
    replica = _engine_deployment("engine", args.replicas, args.router, args, scaling)
    ingress = serve.deployment(Ingress, name="ingress", ray_actor_options={"num_cpus": 0},
                               max_ongoing_requests=10_000)
    wait_s = getattr(args, "cold_start_wait_s", None) if scaling is not None else None
    target = fallback_target(args, model_path)
    admission = ingress_admission(args, tenants, scaling)
    if target is None:
        return ingress.bind(replica.bind(args), model_path, keys, ladder_settings(args, None), assign_wait_s=wait_s,
                            **admission)
    # the fallback's router: least_loaded (the ingress tokenises with the fleet's tokenizer)
    fallback = _engine_deployment("fallback", args.fallback_replicas, "least_loaded", args)
    return ingress.bind(replica.bind(args), model_path, keys, ladder_settings(args, target),
                        fallback=fallback.bind(fallback_args(args)), overflow=target, assign_wait_s=wait_s,
                        **admission)


def ingress_admission(args: argparse.Namespace, tenants, scaling: AutoscaleSettings | None) -> dict:
    """The ingress's admission arguments: the tenants file's limits with the replicas'
    generation caps (``limits.py``), the class-ordered queue's fleet slots (replicas, or
    with autoscaling the most replicas, x ``--max-num-seqs``; none with ``--queue-wait-s 0``)
    and wait bound (``admission.py``), and the replicas' circuit breakers' threshold and open
    seconds (``breaker.py``)."""
    limits = {name: t.limits for name, t in tenants.tenants.items()} if tenants is not None else {}
    caps = (getattr(args, "default_max_tokens", 2048) or None, getattr(args, "max_tokens_limit", None))
    wait_s = getattr(args, "queue_wait_s", 60.0)
    replicas = scaling.max_replicas if scaling is not None else args.replicas
    slots = fleet_slots(replicas, args.max_num_seqs, wait_s)
    breakers = (getattr(args, "breaker_failures", 3), getattr(args, "breaker_open_s", 5.0))
    return {"tenant_limits": limits, "caps": caps, "fleet_slots": slots, "queue_wait_s": wait_s if slots else None,
            "breakers": breakers}


def autoscale_settings(args: argparse.Namespace, model_path: str) -> AutoscaleSettings | None:
    """The fleet's autoscaling (None: ``--autoscale off``, a fixed ``--replicas``); logs the
    capacity and where it came from."""
    from kvserve.cluster.capacity_source import settings_from_args
    settings = settings_from_args(args, model_path) if getattr(args, "autoscale", "off") != "off" else None
    if settings is not None:
        logger.info("autoscale %s, tier %s, replicas %d-%d; capacity per replica: prefill %.1f, decode %.1f "
                    "tokens/s (%s)", settings.mode, settings.tier, settings.min_replicas, settings.max_replicas,
                    settings.prefill_tokens_per_s, settings.decode_tokens_per_s, settings.capacity_source)
    return settings


def _engine_deployment(name: str, replicas: int, policy: str, args: argparse.Namespace,
                       scaling: AutoscaleSettings | None = None):
    """An ``EngineReplica`` deployment routed by ``KVServeRequestRouter`` with ``policy``:
    ``replicas`` of them, or as many as ``KVServeAutoscalingPolicy`` decides with ``scaling``."""
    router = RequestRouterConfig(
        request_router_class="kvserve.cluster.ray_router:KVServeRequestRouter",
        request_router_kwargs={"policy": policy, "weights": getattr(args, "router_weights", None)},
        request_routing_stats_period_s=ROUTING_STATS_PERIOD_S, request_routing_stats_timeout_s=5.0)
    count = {"num_replicas": replicas} if scaling is None else {"autoscaling_config": autoscaling_config(scaling)}
    return serve.deployment(EngineReplica, name=name, **count,
                            ray_actor_options={"num_cpus": args.replica_cpus}, request_router_config=router,
                            max_ongoing_requests=max(64, 4 * args.max_num_seqs), health_check_period_s=2.0)


def fallback_args(args: argparse.Namespace) -> argparse.Namespace:
    """The fallback replicas' ``kvserve serve`` arguments: the fleet's, with the fallback
    model, its own KV budget (``--fallback-kv-cache-gib``, default the fleet's) and nothing
    tied to the fleet's model (served name, draft model, LoRA adapters)."""
    values = dict(vars(args))
    budget = getattr(args, "fallback_kv_cache_gib", None)
    values.update(model=args.fallback_model, kv_cache_gib=budget if budget is not None else args.kv_cache_gib,
                  served_model_name=None, speculative=None, enable_lora=False, lora_modules=None)
    return argparse.Namespace(**values)


def fallback_target(args: argparse.Namespace, model_path: str) -> FallbackTarget | None:
    """What the ingress needs of the fallback (None without ``--fallback-model`` or with
    ``--no-ladder``: the overflow rung is then never engaged)."""
    from kvserve.loader import resolve_model_path
    from kvserve.server.cli import model_names
    if not getattr(args, "fallback_model", None) or not getattr(args, "ladder", True):
        return None
    name, _aliases = model_names(resolve_model_path(args.fallback_model), None)
    _name, fleet = model_names(model_path, getattr(args, "served_model_name", None))
    return FallbackTarget(name, fleet, fleet_slots=args.replicas * args.max_num_seqs)


def ladder_settings(args: argparse.Namespace, target: FallbackTarget | None = None) -> LadderSettings | None:
    """The degradation ladder's settings from the options (None: ``--no-ladder``); the
    ``overflow_chat`` rung is on when ``target`` (the fallback) is given."""
    if not getattr(args, "ladder", True):
        return None
    tenants = frozenset(t.strip() for t in (args.priority_tenants or "").split(",") if t.strip())
    return LadderSettings(chat_ttft_slo_s=args.chat_ttft_slo, engage_dwell_s=args.ladder_dwell_s,
                          release_dwell_s=3 * args.ladder_dwell_s, batch_max_tokens=args.batch_max_tokens,
                          fallback_model=target.model_name if target else None, priority_tenants=tenants)


def run_cluster(args: argparse.Namespace) -> int:
    """Start local Ray on 127.0.0.1, deploy, serve until SIGINT / SIGTERM."""
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    if args.host != LOOPBACK:
        print(f"kvserve cluster serve: --host must be {LOOPBACK} (the local Ray listens on loopback only)",
              file=sys.stderr)
        return 2
    node = start_local_ray(num_cpus=args.ray_cpus)
    print(f"kvserve: Ray node address {node}, GCS {gcs_address()}, logs {logs_dir()}", file=sys.stderr, flush=True)
    serve.start(http_options={"host": args.host, "port": args.port})
    serve.run(build_app(args), name="kvserve", route_prefix="/", blocking=False)
    fallback = f", {args.fallback_replicas} fallback ({args.fallback_model})" if args.fallback_model else ""
    count = f"{args.replicas}" if getattr(args, "autoscale", "off") == "off" else f"autoscaled ({args.autoscale}, tier {args.tier})"
    print(f"kvserve: {count} replicas ({args.router} routing){fallback} on http://{args.host}:{args.port}",
          file=sys.stderr, flush=True)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    stop.wait()
    serve.shutdown()
    stop_local_ray()
    return 0
