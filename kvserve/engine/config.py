"""Engine settings: the user's ``EngineConfig`` (``None`` / ``"auto"`` allowed) and the
``ResolvedConfig`` that ``resolve`` fills from the model and the device before any
component is built. Pure Python: dtypes are names here, torch dtypes in ``model_loading``.
"""
from __future__ import annotations

from dataclasses import dataclass

from kvserve.config import ModelConfig
from kvserve.engine.admission import check_grace_s
from kvserve.engine.scheduler import SchedulerConfig
from kvserve.errors import InvalidRequestError

DTYPE_NAMES = {"float32": "float32", "fp32": "float32", "bfloat16": "bfloat16", "bf16": "bfloat16",
               "float16": "float16", "fp16": "float16"}


@dataclass(frozen=True)
class EngineConfig:
    """Engine settings; ``None`` / ``"auto"`` are resolved from the model and the device."""

    model: str | None = None              # .gguf file, HF folder, or None for the default model
    device: str = "auto"                  # "cpu", "cuda", "auto"
    dtype: str = "auto"                   # "float32", "bfloat16", "float16", "auto" (fp32 CPU, bf16 GPU)
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


@dataclass(frozen=True)
class LoRASettings:
    """Resolved LoRA settings (``EngineConfig.enable_lora`` and the ``max_*`` fields)."""

    max_loras: int
    max_cpu_loras: int
    max_lora_rank: int
    lora_modules: tuple[tuple[str, str], ...] = ()


def resolve(config: EngineConfig, model: ModelConfig, cuda_available: bool) -> ResolvedConfig:
    """Fill the auto values: device (CUDA if there is one), dtype (fp32 on CPU, bf16 on
    GPU), context (the checkpoint's, never more). Raises ``InvalidRequestError`` for a
    setting that cannot work."""
    check_grace_s(config.prefix_cache_grace_s)
    device = ("cuda" if cuda_available else "cpu") if config.device == "auto" else config.device
    if config.dtype == "auto":
        dtype = "bfloat16" if device.startswith("cuda") else "float32"
    elif config.dtype in DTYPE_NAMES:
        dtype = DTYPE_NAMES[config.dtype]
    else:
        raise InvalidRequestError(f"unknown dtype {config.dtype!r}; choose from {sorted(DTYPE_NAMES)}",
                                  param="dtype")
    for name in ("block_size", "max_num_seqs", "max_num_batched_tokens"):
        if getattr(config, name) < 1:
            raise InvalidRequestError(f"{name} must be >= 1", param=name)
    max_model_len = min(config.max_model_len or model.max_position_embeddings, model.max_position_embeddings)
    return ResolvedConfig(lora=resolve_lora(config),
        device=device, dtype=dtype, max_model_len=max_model_len, kv_cache_bytes=config.kv_cache_bytes,
        block_size=config.block_size, num_threads=config.num_threads,
        attention_backend=config.attention_backend, seed=config.seed,
        enable_prefix_cache=config.enable_prefix_cache,
        scheduler=SchedulerConfig(config.max_num_seqs, config.max_num_batched_tokens,
                                  config.prefix_cache_grace_s))


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
