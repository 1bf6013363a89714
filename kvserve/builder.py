"""The composition root: from an ``EngineConfig`` to a running ``EngineCore``.

The config is resolved once (``engine.config.resolve``), the target (and a draft model,
if the proposer needs one) loaded by the one ``load_model``, the KV memory sized by the
planner's formula, then the parts built and injected::

    KVCacheManager(BlockPool, PrefixCache) -> Scheduler(gate) -> ModelRunner(sampler, verifier, batch)
                                                            \\-> Speculator (or none) -> EngineCore

With LoRA on, ``kvserve.lora.build`` wraps the model's projections and gives the
``LoRAManager`` (the scheduler's residency gate and the engine's adapter catalog) and
the ``LoRABatch`` (the runner's batch context).

It lives outside ``engine/`` so that the engine never imports ``speculative/``.
"""
from __future__ import annotations

import contextlib
import logging
import time

import torch

from kvserve.attention import get_backend
from kvserve.engine.bandwidth import measure_copy_bandwidth
from kvserve.engine.config import EngineConfig, resolve
from kvserve.engine.cpu_dtype import pick_cpu_dtype
from kvserve.engine.engine_core import EngineCore
from kvserve.engine.fair_share import FairSharePolicy
from kvserve.engine.kv.block_pool import BlockPool
from kvserve.engine.kv.manager import KVCacheManager
from kvserve.engine.kv.prefix_cache import PrefixCache
from kvserve.engine.kv.tensors import allocate_kv_cache, default_kv_budget_bytes, plan_kv_cache
from kvserve.engine.model_loading import load_model, torch_dtype
from kvserve.engine.model_runner import ModelRunner
from kvserve.engine.policy import FcfsPolicy
from kvserve.engine.scheduler import Scheduler
from kvserve.engine.slo_policy import SloPolicy
from kvserve.engine.step_time import LinearTimeModel
from kvserve.errors import InvalidRequestError
from kvserve.quant.transform import direct_types
from kvserve.speculative.config import speculative_config

logger = logging.getLogger("kvserve.engine")


def kv_bytes_per_token(config, kv_dtype: "str | torch.dtype") -> int:
    """KV bytes one token takes in every layer of ``config``'s model in KV dtype ``kv_dtype``
    (a name such as "float32" or "int8", or a torch float dtype), scales included (the
    planner's formula)."""
    from kvserve.engine.kv.sizing import kv_bytes_per_token as formula, kv_storage
    from kvserve.engine.kv.tensors import kv_dtype_name
    storage = kv_storage(kv_dtype_name(kv_dtype))
    return int(formula(config.num_layers, config.num_kv_heads, config.head_dim,
                       storage.element_bytes, storage.scale_bytes))


def build_kv_cache(resolved, mc, draft, budget: int, device: torch.device, dtype: torch.dtype):
    """(KVCachePlan, cache) for ``budget`` bytes in the resolved KV dtype; with a draft
    model the budget is split by the two models' bytes per token (one block id covers both)."""
    kv_dtype = resolved.kv_cache_dtype          # "float32", ..., "int8", "fp8_e4m3", "fp8_e5m2"
    if draft is not None:
        target_bpt, draft_bpt = (kv_bytes_per_token(c, kv_dtype) for c in (mc, draft.config))
        budget = budget * target_bpt // (target_bpt + draft_bpt)
    kv_plan = plan_kv_cache(mc, budget, kv_dtype, resolved.block_size, resolved.max_model_len)
    if kv_plan.num_blocks < 1:
        raise InvalidRequestError(f"KV budget of {budget} bytes holds no block: {kv_plan.explanation}",
                                  param="kv_cache_bytes")
    logger.info("KV cache (%s): %s", kv_dtype, kv_plan.explanation)
    try:
        return kv_plan, allocate_kv_cache(mc, kv_plan, kv_dtype, device, dtype)
    except ValueError as e:
        raise InvalidRequestError(str(e), param="kv_cache_dtype") from e


def build_policy(resolved, step_time: LinearTimeModel):
    """The scheduling policy the resolved config names (the SLO policy reads the engine's
    step-time model), wrapped in the fair-share policy when that is on."""
    policy = FcfsPolicy() if resolved.scheduling_policy == "fcfs" else SloPolicy(resolved.slo, step_time)
    if resolved.fair_share is not None:
        return FairSharePolicy(policy, resolved.fair_share)
    return policy


def build_constraints(model_path: str, vocab_size: int):
    """Structured output: a ``ConstraintTracker`` over the xgrammar backend for the model's
    vocabulary (read from its tokenizer), or ``NullConstraints`` when xgrammar is missing."""
    from kvserve.engine.constraint import ConstraintTracker, NullConstraints
    try:
        from kvserve.structured import build_constraint_backend
    except ImportError as exc:
        logger.warning("structured output off: %s", exc)
        return NullConstraints()
    from kvserve.tokenizer import Tokenizer
    return ConstraintTracker(build_constraint_backend(Tokenizer.load(model_path), vocab_size))


def build_decode_graphs(resolved, model, kv_cache, mc, batch_context):
    """CUDA graphs for decode steps (``kvserve.engine.cuda_graphs``), or None: off, not on
    CUDA, with LoRA (its transforms read per-step metadata) or a mixture-of-experts model
    (its expert grouping reads counts back to the host)."""
    if not resolved.cuda_graphs or batch_context is not None or hasattr(model, "sparse_blocks"):
        return None
    from kvserve.engine.cuda_graphs import DecodeGraphs
    return DecodeGraphs(model, kv_cache,
                        lambda: get_backend(resolved.attention_backend, mc.num_heads, mc.num_kv_heads, mc.head_dim),
                        resolved.block_size, resolved.scheduler.max_num_seqs,
                        -(-resolved.max_model_len // resolved.block_size), torch.device(resolved.device))


def build_engine(config: EngineConfig, checkpoint=None) -> EngineCore:
    """An engine for ``config``; ``checkpoint`` (already loaded) saves reading it again.
    With ``tensor_parallel_size`` > 1 the workers of ranks 1..N-1 are started here and
    stopped by ``EngineCore.close`` (or if the build fails). The seconds of each start-up
    phase land in ``EngineCore.start_timings`` (docs/coldstart.md)."""
    from kvserve.parallel.auto import pick_tensor_parallel

    timings = PhaseTimer()
    tp_asked = config.tensor_parallel_size not in (1, "1")
    if checkpoint is None:
        with timings.phase("checkpoint_s"):
            checkpoint = _read_checkpoint(config, () if tp_asked else direct_types(config.quantization))
    mc = checkpoint.config
    resolved = resolve(config, mc, torch.cuda.is_available(), pick_cpu_dtype=pick_cpu_dtype,
                       pick_tensor_parallel=pick_tensor_parallel)
    logger.info("dtype %s (%s)", resolved.dtype, resolved.dtype_reason)
    spec = speculative_config(config.speculative)
    launch = None
    if resolved.tensor_parallel_size > 1:
        from kvserve.parallel.build import TensorParallelLaunch, check_layout
        check_layout(resolved, mc)
    if resolved.num_threads:
        torch.set_num_threads(resolved.num_threads)
    device = torch.device(resolved.device)
    with timings.phase("bandwidth_s"):
        bandwidth = measure_copy_bandwidth(device)     # once, for both models' bs=1 bound
    if resolved.tensor_parallel_size > 1:
        launch = TensorParallelLaunch(config.model, resolved, bandwidth)
    try:
        engine = _build_parts(config, resolved, checkpoint, spec, bandwidth, launch, timings)
    except BaseException:
        if launch is not None:
            launch.abort()
        raise
    if resolved.warmup:
        with timings.phase("warmup_s"):
            engine.warm_up()
    engine.start_timings = dict(timings.seconds)
    logger.info("start-up phases (s): %s", ", ".join(f"{k} {v:.3f}" for k, v in timings.seconds.items()))
    return engine


class PhaseTimer:
    """Seconds per named start-up phase (``with timer.phase(name): ...``)."""

    def __init__(self):
        self.seconds: dict[str, float] = {}

    @contextlib.contextmanager
    def phase(self, name: str):
        started = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - started


def _read_checkpoint(config: EngineConfig, kept_quantized: tuple[str, ...]):
    """The checkpoint from its file, or from the host-memory weight cache when one is set."""
    from kvserve.loader import load_checkpoint
    if config.weight_cache_dir is None:
        return load_checkpoint(config.model, kept_quantized)
    from kvserve.coldstart.weight_cache import HostWeightCache, load_cached_checkpoint
    checkpoint, hit = load_cached_checkpoint(config.model, kept_quantized, HostWeightCache(config.weight_cache_dir))
    logger.info("host weight cache %s: %s", config.weight_cache_dir, "hit" if hit else "miss (stored)")
    return checkpoint


def _build_parts(config: EngineConfig, resolved, checkpoint, spec, bandwidth: float, launch,
                 timings: PhaseTimer) -> EngineCore:
    """The engine's parts, built and injected (``launch``: the tensor-parallel ranks, or None)."""
    from kvserve.loader import load_checkpoint
    from kvserve.sampling.sampler import Sampler
    from kvserve.speculative.proposer import ProposerContext
    from kvserve.speculative.registry import proposer_entry
    from kvserve.speculative.speculator import build_speculator
    from kvserve.speculative.verify import Verifier

    mc = checkpoint.config
    entry = proposer_entry(spec.method) if spec else None
    device, dtype = torch.device(resolved.device), torch_dtype(resolved.dtype)
    with timings.phase("weights_s"):
        model = load_model(checkpoint, device, dtype, resolved.quantization, bandwidth,
                           transform=launch.shard if launch else None)
    rank_config = model.rank_config if launch else mc      # the heads this process's KV cache holds
    draft_path = entry.draft_model_path(spec) if entry else None
    draft = (load_model(load_checkpoint(draft_path, direct_types(resolved.quantization)), device, dtype,
                        resolved.quantization, bandwidth) if draft_path else None)
    adapters, batch = None, None
    if resolved.lora is not None:
        from kvserve.lora.build import build_lora
        slots = launch.adapter_slots(resolved.lora, mc, rank_config, device, dtype) if launch else None
        adapters, batch = build_lora(resolved.lora, model, mc, device, dtype, slots)
    budget = resolved.kv_cache_bytes or default_kv_budget_bytes(
        device, model.weight_bytes() + (adapters.slots.nbytes if adapters else 0))
    if launch is not None:          # the replica's budget, split over its ranks
        budget //= resolved.tensor_parallel_size
    with timings.phase("kv_cache_s"):
        kv_plan, kv_cache = build_kv_cache(resolved, rank_config, draft, budget, device, dtype)
    if launch is not None:
        launch.share_kv_plan(kv_plan)
    pool = BlockPool(kv_plan.num_blocks, resolved.block_size)
    kv = KVCacheManager(pool, PrefixCache(pool) if resolved.enable_prefix_cache else None)
    step_time = LinearTimeModel()
    scheduler = Scheduler(resolved.scheduler, kv, resolved.max_model_len, frozenset(mc.eos_token_ids), adapters,
                          build_policy(resolved, step_time))
    sampler = Sampler(seed=resolved.seed)
    verifier = Verifier(sampler, resolved.seed, device) if spec else None
    backend = get_backend(resolved.attention_backend, rank_config.num_heads, rank_config.num_kv_heads,
                          rank_config.head_dim)
    constraints = build_constraints(config.model, mc.vocab_size)
    if launch:
        runner = launch.runner(model, kv_cache, backend, resolved.block_size, device, sampler, verifier, batch,
                               constraints)
    else:
        runner = ModelRunner(model, kv_cache, backend, resolved.block_size, device, sampler, verifier, batch,
                             constraints, build_decode_graphs(resolved, model, kv_cache, rank_config, batch))
    speculator = None
    if spec:
        ctx = ProposerContext(spec, model, rank_config, kv_cache, kv_plan.num_blocks, resolved.block_size,
                              resolved.attention_backend, device, dtype, resolved.seed, draft,
                              launch.draft_runner if launch else None)
        speculator = build_speculator(spec, ctx, verifier, step_time)
    return EngineCore(resolved, mc, kv_plan, scheduler, runner, speculator, adapters, step_time, constraints)
