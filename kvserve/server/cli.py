"""``kvserve serve``: the OpenAI-compatible HTTP server (see docs/server.md)."""
from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys

from kvserve.engine.config import parse_tensor_parallel_size

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"

def register(subparsers) -> None:
    """Add the ``serve`` subcommand."""
    p = subparsers.add_parser("serve", help="run the OpenAI-compatible HTTP server",
                              description="Serve a model over an OpenAI-compatible HTTP API.")
    p.add_argument("--model", default=None, help="a .gguf file or a Hugging Face folder (default: SmolLM2-135M-Instruct)")
    p.add_argument("--served-model-name", default=None, help="the model id clients send (default: from the file)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--api-key", default=os.environ.get("KVSERVE_API_KEY"),
                   help="require 'Authorization: Bearer KEY' (tenant 'default'); env KVSERVE_API_KEY")
    p.add_argument("--api-keys-file", default=None, help="file of 'KEY TENANT' lines or a JSON {key: tenant}")
    p.add_argument("--admin-api-key", default=os.environ.get("KVSERVE_ADMIN_API_KEY"),
                   help="require this key on /admin/*, the LoRA load/unload routes and /metrics (other keys "
                        "get 403); env KVSERVE_ADMIN_API_KEY")
    p.add_argument("--tenants", default=None, metavar="FILE",
                   help="tenants file (TOML or YAML): keys, limits, classes, guards, fair-share weights, audit "
                        "log; see examples/tenants.toml and docs/tenants.md")
    p.add_argument("--audit-log", default=None, metavar="FILE",
                   help="append one JSON line per generation request to FILE (overrides the tenants file's)")
    _add_engine_arguments(p)
    sch = p.add_argument_group("scheduling (docs/latency_classes.md)")
    sch.add_argument("--scheduling-policy", default="slo", choices=["slo", "fcfs"],
                     help="slo: request classes (service_tier) with TTFT/TPOT targets; fcfs: priority, then arrival")
    sch.add_argument("--batch-window-ms", type=float, default=0.0,
                     help="how long a new batch-class (service_tier flex) request may wait to share a step")
    sch.add_argument("--class-targets", default=None, metavar="JSON",
                     help='per-class target overrides, e.g. \'{"interactive": {"tpot_s": 0.1}}\'')
    sch.add_argument("--fair-share", action="store_true",
                     help="share a saturated engine between tenants by weighted tokens served, within each "
                          "class (docs/fairness.md; on with --tenants, whose weights it uses)")
    _add_lora_arguments(p)
    _add_disagg_arguments(p)
    _add_limit_arguments(p)
    p.add_argument("--log-level", default="INFO")
    p.set_defaults(func=run)


def _add_engine_arguments(p) -> None:
    """The engine group: KV budget, batch limits, threads, parallelism, cold start, dtypes."""
    eng = p.add_argument_group("engine")
    eng.add_argument("--kv-cache-gib", type=float, default=None, help="KV cache budget in GiB")
    eng.add_argument("--max-num-seqs", type=int, default=64)
    eng.add_argument("--max-num-batched-tokens", type=int, default=1024)
    eng.add_argument("--max-model-len", type=int, default=None)
    eng.add_argument("--threads", type=int, default=None, help="engine torch threads (default: all cores)")
    eng.add_argument("--tensor-parallel-size", type=parse_tensor_parallel_size, default=1, metavar="N|auto",
                     help="ranks of the model (processes on CPU, GPUs on CUDA); --threads is per rank; "
                          "auto: the smallest that fits (docs/parallelism.md)")
    eng.add_argument("--warmup", action=argparse.BooleanOptionalAction, default=True,
                     help="one warm-up pass at start, not on the first request (docs/coldstart.md)")
    eng.add_argument("--weight-cache", default=None, metavar="DIR",
                     help="read unpacked weights from (and store them in) a host-memory folder, e.g. "
                          "/dev/shm/kvserve-weights: a restart skips reading and unpacking the checkpoint")
    eng.add_argument("--engine-cpus", default=None, help="pin the engine process to these CPUs, e.g. 0 or 0-1")
    eng.add_argument("--http-cpus", default=None, help="pin the HTTP process to these CPUs")
    eng.add_argument("--device", default="auto")
    eng.add_argument("--enforce-eager", action="store_true",
                     help="run every step eagerly: no CUDA graphs for decode steps (GPU only)")
    eng.add_argument("--dtype", default="auto",
                     help="float32 | bfloat16 | float16 | auto (GPU bf16; CPU: bf16 where it measures faster)")
    eng.add_argument("--quantization", default="none", choices=["none", "int8", "int4"],
                     help="weight-only quantisation of the projections (docs/quantization.md)")
    eng.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "int8", "fp8_e4m3", "fp8_e5m2"],
                     help="KV cache storage: auto (= dtype) or an 8-bit format with per-token scales")
    eng.add_argument("--seed", type=int, default=0, help="seed of the engine's unseeded sampling")
    eng.add_argument("--no-prefix-cache", dest="prefix_cache", action="store_false",
                     help="turn the engine's prefix cache off")
    eng.add_argument("--prefix-cache-grace-s", type=float, default=30.0,
                     help="seconds a finished request's cached blocks stay unevictable (default 30, so a "
                          "chat's live turn survives between messages)")
    eng.add_argument("--speculative", default=None, metavar="ngram|draft:MODEL|self:LAYERS",
                     help="speculative decoding: n-gram prompt lookup, a draft model sharing the tokenizer, "
                          "or the model's own first layers")
    eng.add_argument("--num-speculative-tokens", type=int, default=4, help="most drafts per sequence per step")


def _add_disagg_arguments(p) -> None:
    dis = p.add_argument_group("prefill/decode disaggregation (docs/disaggregation.md)")
    dis.add_argument("--disaggregate", action="store_true",
                     help="run a prefill engine and a decode engine as two processes; long uncached prompts "
                          "are prefilled on the first and their KV blocks move to the second")
    dis.add_argument("--disagg-threshold-tokens", type=int, default=512, metavar="N",
                     help="uncached prompt tokens from which a request is prefilled on the prefill engine "
                          "(default 512); shorter ones stay on the decode engine")
    dis.add_argument("--disagg-staging-blocks", type=int, default=512, metavar="N",
                     help="KV blocks in flight between the engines at once (the shared-memory staging area)")
    dis.add_argument("--prefill-threads", type=int, default=None, help="prefill engine torch threads (default --threads)")
    dis.add_argument("--decode-threads", type=int, default=None, help="decode engine torch threads (default --threads)")


def disagg_client_factory(args):
    """With ``--disaggregate``: the engine-client factory for KVServer (a ``DisaggEngineClient``
    bound to the flags); None without. Settings whose KV cannot move are a ValueError."""
    if not getattr(args, "disaggregate", False):
        return None
    import functools
    if getattr(args, "tensor_parallel_size", 1) != 1:
        raise ValueError("--disaggregate needs --tensor-parallel-size 1 (sharded KV cannot move yet)")
    if getattr(args, "kv_cache_dtype", "auto") != "auto":
        raise ValueError("--disaggregate needs --kv-cache-dtype auto (8-bit KV and its scales cannot move yet)")
    if args.disagg_threshold_tokens < 1 or args.disagg_staging_blocks < 1:
        raise ValueError("--disagg-threshold-tokens and --disagg-staging-blocks must be >= 1")
    from kvserve.disagg.driver import DisaggConfig
    from kvserve.server.disagg_client import DisaggEngineClient
    config = DisaggConfig(threshold_tokens=args.disagg_threshold_tokens, staging_blocks=args.disagg_staging_blocks)
    prefill = {"num_threads": args.prefill_threads} if args.prefill_threads else {}
    decode = {"num_threads": args.decode_threads} if args.decode_threads else {}
    return functools.partial(DisaggEngineClient, disagg_config=config, prefill_config=prefill, decode_config=decode)


def _add_limit_arguments(p) -> None:
    lim = p.add_argument_group("limits")
    lim.add_argument("--max-queued-requests", type=int, default=256,
                     help="requests admitted but not yet scheduled; past it: 503 + Retry-After")
    lim.add_argument("--max-queued-tokens", type=int, default=262_144, help="prompt tokens of those requests")
    lim.add_argument("--max-body-bytes", type=int, default=4 * 2**20)
    lim.add_argument("--retry-after", type=int, default=1, help="Retry-After seconds on 503")
    lim.add_argument("--drain-timeout", type=float, default=30.0, help="seconds in-flight requests get on SIGTERM")
    lim.add_argument("--stall-timeout", type=float, default=60.0,
                     help="/ready is 503 when requests run and no token came for this long")
    lim.add_argument("--default-max-tokens", type=int, default=2048,
                     help="generation length of a chat request that names none (cut to the context left); "
                          "0: run to the end of the context")
    lim.add_argument("--max-tokens-limit", type=int, default=None,
                     help="the most max_tokens a request may ask (default: the context); more is a 400")
    lim.add_argument("--default-deadline", type=float, default=None, help="per-request deadline in seconds")
    lim.add_argument("--max-header-bytes", type=int, default=64 * 1024,
                     help="request line + headers; past it: 431 and the connection closes (default 65536)")
    lim.add_argument("--max-header-fields", type=int, default=100, help="header fields per request; past it: 431")
    lim.add_argument("--header-timeout", type=float, default=10.0,
                     help="seconds a request head may take (from the connection's start, or from its first "
                          "byte on a kept-alive connection); then 408 and close")
    lim.add_argument("--body-timeout", type=float, default=30.0,
                     help="seconds without a body byte while the body is read; then 408 and close")
    lim.add_argument("--max-connections", type=int, default=1024,
                     help="open HTTP connections; past it a new one gets 503 + Retry-After and is closed")


def http_limits(args):
    """The HTTP protocol's bounds (``http_protocol.HttpLimits``) from the limit flags."""
    from kvserve.server.http_protocol import HttpLimits
    return HttpLimits(max_header_bytes=args.max_header_bytes, max_header_fields=args.max_header_fields,
                      header_timeout_s=args.header_timeout, body_timeout_s=args.body_timeout,
                      max_connections=args.max_connections, retry_after_s=args.retry_after)


def _add_lora_arguments(p) -> None:
    lora = p.add_argument_group("LoRA adapters (see docs/server.md)")
    lora.add_argument("--enable-lora", action="store_true",
                      help="serve LoRA adapters: loaded at start (--lora-modules) or by POST /v1/load_lora_adapter")
    lora.add_argument("--lora-modules", nargs="+", action="extend", default=None, metavar="NAME=PATH",
                      help="PEFT adapter folders to load at start, as name=path or vLLM's JSON "
                           "'{\"name\": ..., \"path\": ...}'; requests select one with model=NAME "
                           "(implies --enable-lora)")
    lora.add_argument("--max-loras", type=int, default=4, help="adapters resident at once (slots); default 4")
    lora.add_argument("--max-cpu-loras", type=int, default=None,
                      help="adapters kept in host memory (default: 2 x --max-loras)")
    lora.add_argument("--max-lora-rank", type=int, default=16, help="the largest adapter rank; default 16")


def engine_config_from_args(args, model_path: str, base_aliases: frozenset[str] = frozenset()) -> dict:
    """EngineConfig fields (plus ``cpus``) for the engine process. ``base_aliases``: the
    base model's names, which no start-up adapter may take (ValueError)."""
    import math

    from kvserve.server.launcher import pin_cpus
    grace = getattr(args, "prefix_cache_grace_s", 30.0)
    if not 0 <= grace < math.inf:
        raise ValueError(f"--prefix-cache-grace-s must be a finite number >= 0, got {grace}")
    return {"model": model_path, "device": args.device, "dtype": args.dtype,
            "quantization": getattr(args, "quantization", "none"),
            "kv_cache_dtype": getattr(args, "kv_cache_dtype", "auto"),
            "kv_cache_bytes": int(args.kv_cache_gib * 2**30) if args.kv_cache_gib else None,
            "max_num_seqs": args.max_num_seqs, "max_num_batched_tokens": args.max_num_batched_tokens,
            "max_model_len": args.max_model_len, "num_threads": args.threads, "seed": args.seed,
            "tensor_parallel_size": getattr(args, "tensor_parallel_size", 1),
            "warmup": getattr(args, "warmup", False), "weight_cache_dir": getattr(args, "weight_cache", None),
            "cuda_graphs": not getattr(args, "enforce_eager", False),
            "enable_prefix_cache": getattr(args, "prefix_cache", True), "prefix_cache_grace_s": grace,
            "speculative": speculative_config(args), "cpus": pin_cpus(args.engine_cpus),
            **scheduling_config(args), **lora_config(args, base_aliases)}


def scheduling_config(args) -> dict:
    """The scheduling flags as EngineConfig fields (checked again by the engine's resolve)."""
    import json
    targets = getattr(args, "class_targets", None)
    if targets is not None:
        targets = json.loads(targets)
        if not isinstance(targets, dict):
            raise ValueError("--class-targets must be a JSON object of class -> {ttft_s, tpot_s, shapes_budget}")
    window_ms = getattr(args, "batch_window_ms", 0.0)
    if not 0 <= window_ms <= 10_000:
        raise ValueError(f"--batch-window-ms must be within [0, 10000], got {window_ms}")
    return {"scheduling_policy": getattr(args, "scheduling_policy", "slo"), "class_targets": targets,
            "batch_window_s": window_ms / 1000.0, "fair_share": bool(getattr(args, "fair_share", False))}


def lora_config(args, base_aliases: frozenset[str] = frozenset()) -> dict:
    """The LoRA flags as EngineConfig fields (``--lora-modules`` implies ``--enable-lora``)."""
    from kvserve.server.lora import lora_modules_config
    modules = lora_modules_config(getattr(args, "lora_modules", None), base_aliases)
    return {"enable_lora": bool(getattr(args, "enable_lora", False) or modules),
            "max_loras": getattr(args, "max_loras", 4), "max_cpu_loras": getattr(args, "max_cpu_loras", None),
            "max_lora_rank": getattr(args, "max_lora_rank", 16), "lora_modules": modules or None}


def speculative_config(args):
    """``--speculative`` / ``--num-speculative-tokens`` as SpeculativeConfig fields (a
    plain dict: it travels to the engine process in the codec; None: off)."""
    import dataclasses

    from kvserve.speculative.config import SpeculativeConfig
    spec = getattr(args, "speculative", None)
    if not spec:
        return None
    return dataclasses.asdict(SpeculativeConfig.parse(
        spec, num_speculative_tokens=getattr(args, "num_speculative_tokens", 4)))


def model_names(model_path: str, served: str | None) -> tuple[str, frozenset[str]]:
    """The model id /v1/models lists, and every id a request may send."""
    from kvserve.errors import KVServeError
    from kvserve.loader import default_model_path
    from kvserve.loader.api import DEFAULT_MODEL_ALIASES
    stem = os.path.basename(model_path.rstrip("/"))
    stem = stem[:-5] if stem.endswith(".gguf") else stem
    aliases = {stem, model_path}
    try:
        if os.path.samefile(model_path, default_model_path()):
            stem = DEFAULT_MODEL_NAME
            aliases |= set(DEFAULT_MODEL_ALIASES) | {stem, "HuggingFaceTB/" + stem}
    except (OSError, KVServeError):
        pass
    name = served or stem
    return name, frozenset(aliases | {name})


def build_server(args):
    """A KVServer for these arguments (loads the tokenizer; the engine starts in serve())."""
    from kvserve.loader import resolve_model_path
    from kvserve.server.app import ServingContext
    from kvserve.server.engine_client import EngineClient
    from kvserve.server.launcher import KVServer
    from kvserve.server.metrics import ServerMetrics
    from kvserve.server.state import AdmissionLimits, ServerState
    from kvserve.server.tenants import load_tenants
    from kvserve.tokenizer import Tokenizer

    model_path = resolve_model_path(args.model)
    name, aliases = model_names(model_path, args.served_model_name)
    limits = AdmissionLimits(args.max_queued_requests, args.max_queued_tokens, args.retry_after,
                             args.stall_timeout)
    tenants = load_tenants(args.tenants) if getattr(args, "tenants", None) else None
    api_keys, admin_keys = server_keys(args, tenants)
    engine_config = engine_config_from_args(args, model_path, aliases)
    if tenants is not None:          # tenants share the engine by weighted tokens served
        engine_config.update(fair_share=True, tenant_weights=tenants.weights())
    ctx = ServingContext(tokenizer=Tokenizer.load(model_path), model_name=name, model_aliases=aliases,
                         state=ServerState(limits), metrics=ServerMetrics(), max_body_bytes=args.max_body_bytes,
                         default_deadline_s=args.default_deadline, api_keys=api_keys, admin_keys=admin_keys,
                         default_max_tokens=getattr(args, "default_max_tokens", 2048) or None,
                         max_tokens_limit=getattr(args, "max_tokens_limit", None))
    ctx.tenancy = build_tenancy(tenants, getattr(args, "tenants", None), getattr(args, "audit_log", None), ctx)
    factory = disagg_client_factory(args)
    ctx.disaggregated = factory is not None
    return KVServer(ctx, engine_config, args.host, args.port, drain_timeout_s=args.drain_timeout,
                    http_limits=http_limits(args), client_factory=factory or EngineClient)


def server_keys(args, tenants) -> tuple[dict, tuple[str, ...]]:
    """(key -> grant, admin keys) from --api-key, --api-keys-file, --admin-api-key and the
    tenants file; a key given twice or an empty admin key is a ValueError."""
    from kvserve.server.auth import KeyGrant, load_keys
    api_keys = load_keys(args.api_key, args.api_keys_file)
    admin_key = getattr(args, "admin_api_key", None)
    if admin_key is not None and not admin_key.strip():
        raise ValueError("--admin-api-key (or KVSERVE_ADMIN_API_KEY) is empty; unset it or give a key")
    admin_keys = (admin_key,) if admin_key is not None else ()
    if tenants is not None:
        admin_keys += tuple(k for k in tenants.admin_keys if k not in admin_keys)
        for name, tenant in tenants.tenants.items():
            for key in tenant.keys:
                if key in api_keys:
                    raise ValueError(f"tenants file: a key of tenant {name!r} is also given by --api-key or "
                                     "--api-keys-file")
                api_keys[key] = KeyGrant(name, tenant.service_class)
    if any(key in api_keys for key in admin_keys):
        raise ValueError("an admin key must differ from every API key")
    return api_keys, admin_keys


def build_tenancy(tenants, tenants_path: str | None, audit_log: str | None, ctx):
    """The tenants file's rules for the HTTP process (guards built from its [guards];
    model guards ask ``ctx``'s engine)."""
    from kvserve.server.guarding import build_guard_sets
    from kvserve.server.tenancy import Tenancy
    try:
        guard_sets = build_guard_sets(tenants, ctx)
    except ValueError as exc:
        raise ValueError(f"{tenants_path}: {exc}") from None
    return Tenancy.from_config(tenants, guard_sets, audit_log)


def run(args) -> int:
    from kvserve.errors import KVServeError
    from kvserve.server.launcher import pin_cpus, set_http_affinity

    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s",
                        stream=sys.stderr)
    os.environ.setdefault("KVSERVE_LOG_LEVEL", args.log_level.upper())
    set_http_affinity(pin_cpus(args.http_cpus))
    try:
        server = build_server(args)
    except (KVServeError, OSError, ValueError) as err:
        print(f"kvserve serve: {getattr(err, 'message', err)}", file=sys.stderr)
        return 2
    print(f"kvserve: serving {server.ctx.model_name!r} on http://{args.host}:{args.port}", file=sys.stderr)
    try:
        import uvloop
        return uvloop.run(server.serve())
    except ImportError:
        return asyncio.run(server.serve())
