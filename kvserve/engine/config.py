"""Engine settings: the user's ``EngineConfig`` (``None`` / ``"auto"`` allowed) and the
``ResolvedConfig`` that ``resolve`` fills from the model and the device before any
component is built. Pure Python: dtypes are names here, torch dtypes in ``model_loading``.
"""
from __future__ import annotations

from dataclasses import dataclass

from kvserve.config import ModelConfig
from kvserve.engine.admission import check_grace_s
from kvserve.engine.fair_share import FairShareSettings, check_weights
from kvserve.engine.scheduler import SchedulerConfig
from kvserve.engine.service_class import parse_class
from kvserve.engine.slo_policy import DEFAULT_TARGETS, ClassTargets, SloPolicySettings
from kvserve.errors import InvalidRequestError

DTYPE_NAMES = {"float32": "float32", "fp32": "float32", "bfloat16": "bfloat16", "bf16": "bfloat16",
               "float16": "float16", "fp16": "float16"}
QUANTIZATIONS = ("none", "int8", "int4")
QUANTIZED_KV_DTYPES = ("int8", "fp8_e4m3", "fp8_e5m2")
SCHEDULING_POLICIES = ("slo", "fcfs")


@dataclass(frozen=True)
class EngineConfig:
    """Engine settings; ``None`` / ``"auto"`` are resolved from the model and the device."""

    model: str | None = None              # .gguf file, HF folder, or None for the default model
    device: str = "auto"                  # "cpu", "cuda", "auto"
    dtype: str = "auto"                   # "float32", "bfloat16", "float16", "auto" (GPU bf16; CPU: measured)
    quantization: str = "none"            # weight-only: "none", "int8" (per channel), "int4" (grouped)
    kv_cache_dtype: str = "auto"          # "auto" (= dtype), "int8", "fp8_e4m3", "fp8_e5m2"
    kv_cache_bytes: int | None = None     # KV memory budget; None = default_kv_budget_bytes
    block_size: int = 16
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 1024
    max_model_len: int | None = None      # None = the checkpoint's context length
    num_threads: int | None = None        # torch intra-op threads on CPU; None = all cores
    attention_backend: str = "torch"
    seed: int = 0                         # for unseeded sampling
    enable_prefix_cache: bool = True      # reuse KV blocks across requests (--no-prefix-cache)
    prefix_cache_grace_s: float = 0.0     # a finished request's blocks stay unevictable this long
    # Speculative decoding: None (off), "ngram", "draft:<model>", "self:<layers>", or a
    # kvserve.speculative.config.SpeculativeConfig (or a dict of its fields) for the finer knobs.
    speculative: object = None
    # LoRA adapters (kvserve.lora): resident slots, host-tier size (None: 2 x max_loras),
    # the largest rank a slot holds, and adapters to load at start ({name: PEFT folder}).
    enable_lora: bool = False
    max_loras: int = 4
    max_cpu_loras: int | None = None
    max_lora_rank: int = 16
    lora_modules: dict | None = None
    # Scheduling (docs/latency_classes.md): "slo" (request classes with TTFT/TPOT targets)
    # or "fcfs" (priority, then arrival). class_targets overrides targets per class, e.g.
    # {"interactive": {"tpot_s": 0.1}}; batch_window_s: how long a new batch-class request
    # may wait to share a step.
    scheduling_policy: str = "slo"
    class_targets: dict | None = None
    batch_window_s: float = 0.0
    max_passed_over_steps: int = 32
    min_step_tokens: int = 32
    # Fair sharing between tenants (docs/fairness.md): order tenants by weighted tokens
    # served within the policy's classes; tenant_weights: {tenant: weight > 0}, others 1.
    fair_share: bool = False
    tenant_weights: dict | None = None
    # Tensor parallelism (kvserve.parallel): ranks of this replica, or "auto" (the smallest
    # that fits, by the planner's memory functions; 1 on CPU).
    tensor_parallel_size: int | str = 1
    # Cold start (docs/coldstart.md): run one warm-up pass at start instead of on the first
    # request; read unpacked weights from a host-memory cache folder (None: off).
    warmup: bool = False
    weight_cache_dir: str | None = None
    # Decode steps replayed as CUDA graphs on a CUDA device (kvserve.engine.cuda_graphs);
    # False runs every step eagerly (``--enforce-eager``). No effect on CPU.
    cuda_graphs: bool = True


@dataclass(frozen=True)
class ResolvedConfig:
    """Every engine setting with its auto value filled; components take scalars from it."""

    device: str                           # "cpu" or "cuda"
    dtype: str                            # "float32", "bfloat16" or "float16"
    max_model_len: int
    kv_cache_bytes: int | None            # None: measured after the weights are loaded
    block_size: int
    num_threads: int | None
    attention_backend: str
    seed: int
    enable_prefix_cache: bool
    scheduler: SchedulerConfig
    lora: "LoRASettings | None" = None    # None: LoRA off
    quantization: str = "none"            # "none", "int8", "int4"
    kv_cache_dtype: str = "float32"       # a DTYPE_NAMES value or one of QUANTIZED_KV_DTYPES
    dtype_reason: str = ""                # why ``dtype`` was chosen (logged at start)
    scheduling_policy: str = "slo"        # "slo" or "fcfs"
    slo: SloPolicySettings | None = None  # the SLO policy's settings (None for fcfs)
    fair_share: FairShareSettings | None = None   # None: fair sharing off
    tensor_parallel_size: int = 1         # ranks of this replica (kvserve.parallel)
    tensor_parallel_reason: str = ""      # why (logged at start)
    warmup: bool = False                  # one warm-up pass at start
    weight_cache_dir: str | None = None   # host-memory weight cache folder (None: off)
    cuda_graphs: bool = False             # decode steps as CUDA graphs (CUDA only)


@dataclass(frozen=True)
class LoRASettings:
    """Resolved LoRA settings (``EngineConfig.enable_lora`` and the ``max_*`` fields)."""

    max_loras: int
    max_cpu_loras: int
    max_lora_rank: int
    lora_modules: tuple[tuple[str, str], ...] = ()


def resolve(config: EngineConfig, model: ModelConfig, cuda_available: bool,
            pick_cpu_dtype=None, pick_tensor_parallel=None) -> ResolvedConfig:
    """Fill the auto values: device (CUDA if there is one), dtype (bf16 on GPU; on CPU
    ``pick_cpu_dtype()`` -> (name, reason), fp32 without one), KV dtype (the compute
    dtype), context (the checkpoint's, never more), tensor-parallel size ("auto":
    ``pick_tensor_parallel(model, device, dtype, kv dtype, context, block size, token
    budget, seqs)`` -> (size, reason)). Raises ``InvalidRequestError`` for a setting that
    cannot work."""
    check_grace_s(config.prefix_cache_grace_s)
    device = ("cuda" if cuda_available else "cpu") if config.device == "auto" else config.device
    dtype, reason = resolve_dtype(config.dtype, device, pick_cpu_dtype)
    if config.quantization not in QUANTIZATIONS:
        raise InvalidRequestError(f"unknown quantization {config.quantization!r}; choose from "
                                  f"{list(QUANTIZATIONS)}", param="quantization")
    kv_dtype = resolve_kv_dtype(config.kv_cache_dtype, dtype)
    for name in ("block_size", "max_num_seqs", "max_num_batched_tokens"):
        if getattr(config, name) < 1:
            raise InvalidRequestError(f"{name} must be >= 1", param=name)
    max_model_len = min(config.max_model_len or model.max_position_embeddings, model.max_position_embeddings)
    tp, tp_reason = resolve_tensor_parallel(config, model, device, dtype, kv_dtype, max_model_len,
                                            pick_tensor_parallel)
    return ResolvedConfig(lora=resolve_lora(config), tensor_parallel_size=tp, tensor_parallel_reason=tp_reason,
        warmup=bool(config.warmup), weight_cache_dir=config.weight_cache_dir,
        cuda_graphs=bool(config.cuda_graphs) and device == "cuda",
        device=device, dtype=dtype, max_model_len=max_model_len, kv_cache_bytes=config.kv_cache_bytes,
        block_size=config.block_size, num_threads=config.num_threads,
        attention_backend=config.attention_backend, seed=config.seed,
        enable_prefix_cache=config.enable_prefix_cache,
        scheduler=SchedulerConfig(config.max_num_seqs, config.max_num_batched_tokens,
                                  config.prefix_cache_grace_s),
        quantization=config.quantization, kv_cache_dtype=kv_dtype, dtype_reason=reason,
        scheduling_policy=config.scheduling_policy, slo=resolve_slo(config),
        fair_share=resolve_fair_share(config))


def parse_tensor_parallel_size(text: str) -> int | str:
    """A ``--tensor-parallel-size`` value: "auto" or an integer >= 1 (argparse type)."""
    if text == "auto":
        return text
    if not text.isdigit() or int(text) < 1:
        raise ValueError(f"--tensor-parallel-size takes an integer >= 1 or 'auto', not {text!r}")
    return int(text)


def resolve_tensor_parallel(config: EngineConfig, model: ModelConfig, device: str, dtype: str, kv_dtype: str,
                            max_model_len: int, pick=None) -> tuple[int, str]:
    """(ranks, why): as configured (an int >= 1), or "auto" by ``pick`` (1 without one)."""
    size = config.tensor_parallel_size
    if size == "auto":
        if pick is None:
            return 1, "auto: no picker given"
        return pick(model, device, dtype, kv_dtype, max_model_len, config.block_size,
                    config.max_num_batched_tokens, config.max_num_seqs)
    try:
        size = int(size)
    except (TypeError, ValueError):
        size = 0
    if size < 1:
        raise InvalidRequestError(f"tensor_parallel_size must be an integer >= 1 or 'auto', not "
                                  f"{config.tensor_parallel_size!r}", param="tensor_parallel_size")
    return size, "as configured"


def resolve_fair_share(config: EngineConfig) -> FairShareSettings | None:
    """The fair-share settings (None when ``fair_share`` is off); ``tenant_weights`` are
    checked either way (names are strings, weights finite and > 0)."""
    if config.tenant_weights is not None and not isinstance(config.tenant_weights, dict):
        raise InvalidRequestError("tenant_weights must be a map of tenant -> weight", param="tenant_weights")
    try:
        weights = check_weights(config.tenant_weights)
    except ValueError as e:
        raise InvalidRequestError(f"tenant_weights: {e}", param="tenant_weights") from None
    return FairShareSettings(weights) if config.fair_share else None


def resolve_slo(config: EngineConfig) -> SloPolicySettings | None:
    """The SLO policy's settings (None with the fcfs policy); class targets merged over
    the defaults field by field."""
    if config.scheduling_policy not in SCHEDULING_POLICIES:
        raise InvalidRequestError(f"unknown scheduling_policy {config.scheduling_policy!r}; choose from "
                                  f"{list(SCHEDULING_POLICIES)}", param="scheduling_policy")
    if config.scheduling_policy != "slo":
        return None
    if not 0.0 <= config.batch_window_s <= 10.0:
        raise InvalidRequestError("batch_window_s must be within [0, 10] seconds", param="batch_window_s")
    for name in ("max_passed_over_steps", "min_step_tokens"):
        if getattr(config, name) < 1:
            raise InvalidRequestError(f"{name} must be >= 1", param=name)
    targets = dict(DEFAULT_TARGETS)
    for name, fields in (config.class_targets or {}).items():
        try:
            service_class = parse_class(name)
            merged = {**vars(targets[service_class]), **fields}
            targets[service_class] = ClassTargets(float(merged["ttft_s"]), float(merged["tpot_s"]),
                                                  bool(merged["shapes_budget"]))
        except (ValueError, TypeError, KeyError) as e:
            raise InvalidRequestError(f"class_targets[{name!r}]: {e}", param="class_targets") from None
        if set(fields) - {"ttft_s", "tpot_s", "shapes_budget"}:
            raise InvalidRequestError(f"class_targets[{name!r}]: fields are ttft_s, tpot_s, shapes_budget",
                                      param="class_targets")
    return SloPolicySettings(targets, config.batch_window_s, config.max_passed_over_steps,
                             config.min_step_tokens)


def resolve_dtype(name: str, device: str, pick_cpu_dtype=None) -> tuple[str, str]:
    """(compute dtype, why): as asked, or for "auto" bf16 on GPU and on CPU what
    ``pick_cpu_dtype()`` measured (fp32 when no picker is given)."""
    if name == "auto":
        if device.startswith("cuda"):
            return "bfloat16", "auto: bf16 on GPU"
        if pick_cpu_dtype is None:
            return "float32", "auto: fp32 on CPU"
        return pick_cpu_dtype()
    if name not in DTYPE_NAMES:
        raise InvalidRequestError(f"unknown dtype {name!r}; choose from {sorted(DTYPE_NAMES)}", param="dtype")
    return DTYPE_NAMES[name], "as configured"


def resolve_kv_dtype(name: str, dtype: str) -> str:
    """The KV cache's storage dtype: "auto" is the compute dtype; or a float dtype name,
    or one of the 8-bit formats (which carry scales, see ``kvserve.engine.kv.quantized``)."""
    if name == "auto":
        return dtype
    if name in QUANTIZED_KV_DTYPES:
        return name
    if name in DTYPE_NAMES:
        return DTYPE_NAMES[name]
    raise InvalidRequestError(f"unknown kv_cache_dtype {name!r}; choose from "
                              f"{['auto', *QUANTIZED_KV_DTYPES, *sorted(set(DTYPE_NAMES.values()))]}",
                              param="kv_cache_dtype")


def resolve_lora(config: EngineConfig) -> LoRASettings | None:
    """LoRA settings, or None when LoRA is off (``lora_modules`` turns it on)."""
    modules = tuple((str(name), str(path)) for name, path in (config.lora_modules or {}).items())
    if not (config.enable_lora or modules):
        return None
    for name in ("max_loras", "max_lora_rank"):
        if getattr(config, name) < 1:
            raise InvalidRequestError(f"{name} must be >= 1", param=name)
    host = config.max_cpu_loras if config.max_cpu_loras is not None else 2 * config.max_loras
    if host < config.max_loras:
        raise InvalidRequestError(f"max_cpu_loras ({host}) must be >= max_loras ({config.max_loras})",
                                  param="max_cpu_loras")
    return LoRASettings(config.max_loras, host, config.max_lora_rank, modules)
