"""Engine core: one step of the step contract (docs/architecture.md) over injected components.

It sees token ids and ``EngineRequest`` only (no HTTP, JSON, chat templates or text).
``kvserve.builder.build_engine`` resolves the config, loads the model and builds the
parts; here they are composed::

    plan    = scheduler.schedule()              who runs, how many tokens (ints and lists)
    speculator.extend(plan, scheduler)          lookahead tokens (a no-op when off)
    result  = runner.execute(plan)              tensors, forward, sampling, verification
    updates = scheduler.update(plan, result)    tokens appended, stops, blocks freed
    speculator.observe(plan, result, updates)   learn acceptance and step times
"""
from __future__ import annotations

import math
import time

from kvserve.config import ModelConfig
from kvserve.engine.adapter_catalog import AdapterCatalog
from kvserve.engine.admission import EngineLimits, check_context, check_grace_s, check_logit_bias, check_token_ids
from kvserve.engine.config import ResolvedConfig
from kvserve.engine.constraint import NullConstraints
from kvserve.engine import weight_swap
from kvserve.engine.fair_share import tenant_served_tokens
from kvserve.engine.kv.cache_events import CacheEvent, CacheNamespace, prompt_block_hashes
from kvserve.engine.kv.manager import KVCacheManager, KVImportResult
from kvserve.engine.kv.sizing import KVCachePlan
from kvserve.engine.lookahead import NullSpeculator, Speculator
from kvserve.engine.request import EngineRequest, RequestStatus
from kvserve.engine.scheduler import Scheduler
from kvserve.engine.sequence import FinishReason
from kvserve.engine.stats import AdapterCounters, EngineStats, PrefixSubtree
from kvserve.engine.step import SeqUpdate
from kvserve.engine.step_time import LinearTimeModel, StepClock
from kvserve.errors import AdapterNotFoundError, EngineBusyError, InvalidRequestError

SUBTREES_SHOWN = 8            # prefix-cache branches reported in EngineStats (the console shows them)
SUBTREES_REFRESH_S = 1.0      # how often they are recounted


class EngineCore:
    """The offline engine: add requests, call ``step()`` until nothing is unfinished."""

    def __init__(self, config: ResolvedConfig, model_config: ModelConfig, kv_plan: KVCachePlan,
                 scheduler: Scheduler, runner, speculator: Speculator | None = None,
                 adapters: AdapterCatalog | None = None, step_time: LinearTimeModel | None = None,
                 constraints=None):
        self.config = config
        self.model_config = model_config
        self.max_model_len = config.max_model_len
        self.kv_plan = kv_plan
        self.scheduler = scheduler
        self.kv: KVCacheManager = scheduler.kv
        self.runner = runner
        self.start_timings: dict[str, float] = {}    # start-up phase -> seconds (set by the builder)
        self.asleep = None                   # weight_swap.Asleep while the KV cache is freed
        self.speculator = speculator or NullSpeculator()
        self.adapters = adapters             # LoRA adapters (None: base weights only)
        self.step_time = step_time or LinearTimeModel()   # measured steps (shared with the policy)
        self.limits = EngineLimits(config.max_model_len, model_config.vocab_size, config.block_size,
                                   kv_plan.num_blocks, kv_plan.max_tokens)
        self.num_steps = 0
        self.step_clock = StepClock()        # the steps' wall and CPU seconds (the host's share)
        self._last_plan_empty = False
        # structured output: compiles (and so checks) a request's constraint; the runner masks
        self.constraints = constraints or NullConstraints()
        self._subtrees: list[PrefixSubtree] = []      # the prefix cache's largest branches, as last seen
        self._subtrees_at = -math.inf                 # when (monotonic seconds)

    @property
    def block_pool(self):
        return self.kv.block_pool

    @property
    def device(self):
        return self.runner.device

    @property
    def dtype(self):
        """The compute dtype (a torch dtype; an 8-bit KV cache dequantises to it)."""
        return self.asleep.dtype if self.asleep is not None else self.runner.kv_cache.dtype

    @property
    def kv_cache_dtype(self) -> str:
        """The KV cache's storage dtype: "float32", "bfloat16", ..., "int8", "fp8_e4m3", "fp8_e5m2"."""
        return self.config.kv_cache_dtype

    @property
    def decode_read_bytes(self) -> int:
        """Weight bytes one decode step streams (the single-request bandwidth bound)."""
        return self.runner.model.decode_read_bytes()

    @property
    def prefix_cache(self):
        return self.kv.prefix_cache

    # ---------------------------------------------------------------- requests
    def add_request(self, request: EngineRequest) -> None:
        """Validate and queue a request; its ``params.n`` sequences share its prompt blocks.
        ``request.adapter_id`` names an adapter; it runs with whatever is loaded under
        that name now (its identity is fixed here, a later reload does not change it)."""
        self.scheduler.add_request(request, self.validate_request(request))

    def adapter_key(self, name: str | None) -> str | None:
        """The identity of the adapter loaded as ``name`` (None: the base weights)."""
        if name is None:
            return None
        if self.adapters is None:
            raise AdapterNotFoundError(f"the model {name!r} does not exist: LoRA adapters are not enabled "
                                       "on this engine", param="model")
        return self.adapters.resolve(name)

    def validate_request(self, request: EngineRequest) -> str | None:
        """Raise a typed error if this request cannot run here; changes nothing. Returns
        the identity of the adapter it would run with (None: the base weights)."""
        if self.asleep is not None:
            raise EngineBusyError("the engine is asleep: wake it before sending requests")
        key = self.adapter_key(request.adapter_id) if request.adapter_id is not None else None
        request.params.validate()
        check_token_ids(request.prompt_token_ids, self.limits.vocab_size)
        check_logit_bias(request.params.logit_bias, self.limits.vocab_size)
        check_context(len(request.prompt_token_ids), request.params.max_tokens, self.limits)
        check_grace_s(request.prefix_cache_grace_s)
        if request.structured is not None:
            self.constraints.validate(request.structured)     # compiles it (cached) or names the field
        return key

    def abort_request(self, request_id: str) -> list[SeqUpdate]:
        """Abort every sequence of a request now; their blocks are freed at once."""
        updates = self.scheduler.abort_request(request_id)
        self.speculator.forget([u.seq_id for u in updates])
        return updates

    def stop_sequence(self, seq_id: int) -> None:
        """Finish one sequence with reason ``stop`` (the front end matched a stop string)."""
        self.scheduler.finish_sequence(seq_id, FinishReason.STOP)
        self.speculator.forget([seq_id])

    def request_status(self, request_id: str) -> RequestStatus | None:
        """WAITING (nothing computed yet), RUNNING, or None once the request has ended."""
        return self.scheduler.request_status(request_id)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def idle_wait_s(self) -> float | None:
        """When the last step was empty because the policy holds requests back (a batching
        window): seconds until one may run, for a caller that would otherwise spin."""
        return self.scheduler.wake_in_s() if self._last_plan_empty else None

    # -------------------------------------------------------------------- step
    def step(self) -> list[SeqUpdate]:
        """One engine step; returns what each sequence produced."""
        with self.step_clock:
            return self._step()

    def _step(self) -> list[SeqUpdate]:
        plan = self.scheduler.schedule()
        self._last_plan_empty = plan.is_empty
        if not plan.is_empty:
            self.speculator.extend(plan, self.scheduler)
        result = self.runner.execute(plan)
        self.num_steps += 1
        updates = self.scheduler.update(plan, result)
        if not plan.is_empty:
            self.step_time.observe(plan.num_tokens, result.forward_time_s)
            self.speculator.observe(plan, result, updates)
        return updates

    def warm_up(self) -> float:
        """One warm-up pass (``ModelRunner.warm_up``) before any request; returns its seconds."""
        return self.runner.warm_up()

    # ------------------------------------------------- weights in place, sleep / wake
    def load_weights(self, model_path: str) -> dict:
        """Swap in a same-shaped checkpoint between steps (idle engine), bumping the weight
        epoch (``engine/weight_swap.py``)."""
        return weight_swap.load_weights(self, model_path)

    def sleep(self) -> dict:
        """Free the KV cache (GPU weights to host memory) until ``wake``."""
        return weight_swap.sleep(self)

    def wake(self) -> dict:
        """Weights back, a zeroed KV cache of the same plan."""
        return weight_swap.wake(self)

    def close(self) -> None:
        """Release what the runner started (a tensor-parallel runner's worker ranks)."""
        self.runner.close()

    # ---------------------------------------------------------------- adapters
    def load_adapter(self, name: str, path: str) -> dict:
        """Load a PEFT LoRA folder as ``name`` (a clear ``AdapterLoadError`` if it cannot
        be served); its description."""
        return self._catalog().load(name, path)

    def unload_adapter(self, name: str) -> None:
        """New requests can no longer select ``name``; running ones finish with it."""
        self._catalog().unload(name)

    def list_adapters(self) -> list[dict]:
        """The loaded adapters (empty when LoRA is off)."""
        return self.adapters.describe() if self.adapters is not None else []

    def _catalog(self) -> AdapterCatalog:
        if self.adapters is None:
            raise InvalidRequestError("LoRA adapters are not enabled on this engine (enable_lora / "
                                      "--lora-modules)", param="lora_name")
        return self.adapters

    # ------------------------------------------------------------ prefix cache
    def reset_prefix_cache(self) -> int:
        """Admin: drop every cached block no running request uses (grace ignored);
        returns how many. Authentication is the caller's job."""
        return self.kv.reset_prefix_cache()

    def bump_weight_epoch(self) -> int:
        """Call after reloading weights: new requests use a new cache namespace, so no
        block computed with older weights is matched again; the older epochs' unlocked
        blocks are dropped now, the rest when their requests finish and LRU reaches them."""
        return self.kv.bump_weight_epoch()

    @property
    def weight_epoch(self) -> int:
        return self.kv.weight_epoch

    def drain_cache_events(self) -> list[CacheEvent]:
        """Block stored / removed events since the last drain (for a cache-aware router)."""
        return self.kv.drain_events()

    # ------------------------------------------ KV export / import (disaggregation)
    def prompt_namespace(self, adapter_id: str | None, cache_salt: str | None) -> CacheNamespace | None:
        """The prefix-cache namespace a request with this adapter name and salt uses now
        (None: the prefix cache is off, so nothing can be exported or imported)."""
        return self.kv.namespace_for(self.adapter_key(adapter_id), cache_salt, True)

    def cached_prompt_blocks(self, token_ids: list[int], adapter_id: str | None = None,
                             cache_salt: str | None = None) -> int:
        """Leading full blocks of the prompt this engine's prefix cache holds now."""
        namespace = self.prompt_namespace(adapter_id, cache_salt)
        return self.kv.num_cached_prompt_blocks(namespace, token_ids) if namespace is not None else 0

    def export_prompt_kv(self, token_ids: list[int], adapter_id: str | None, cache_salt: str | None,
                         first_block: int):
        """The cached KV of the prompt's full blocks from ``first_block`` on: ``(block_hashes,
        kv)`` with ``kv [layers, 2, n, block_size, KVH, D]`` a copy (every layer's K and V),
        n = cached full blocks - ``first_block`` (may be 0: ``kv`` None). Call between steps
        (e.g. right after the step that finished the request that computed them)."""
        from kvserve.engine.kv.tensors import read_kv_blocks
        namespace = self.prompt_namespace(adapter_id, cache_salt)
        if namespace is None:
            return [], None
        handle = self.kv.lock_prompt_prefix(namespace, token_ids)
        try:
            block_ids = list(handle.block_ids[first_block:])
            if not block_ids:
                return [], None
            hashes = prompt_block_hashes(namespace, token_ids, self.kv.block_size)
            return hashes[first_block:handle.num_blocks], read_kv_blocks(self._kv_tensor(), block_ids)
        finally:
            self.kv.unlock_prefix(handle)

    def import_prompt_kv(self, token_ids: list[int], adapter_id: str | None, cache_salt: str | None,
                         first_block: int, block_hashes: list[int], kv, grace_s: float = 0.0) -> KVImportResult:
        """Put KV computed elsewhere into this engine's prefix cache: blocks ``[first_block,
        first_block + len(block_hashes))`` of the prompt, ``kv`` as ``export_prompt_kv``
        returns it. Blocks already cached are skipped; hashes that disagree with this
        engine's namespace (another weight epoch, adapter or salt) refuse all. The blocks
        end cached-only, protected ``grace_s`` seconds; nothing else is held after."""
        offered = len(block_hashes)
        namespace = self.prompt_namespace(adapter_id, cache_salt)
        mine = prompt_block_hashes(namespace, token_ids, self.kv.block_size) if namespace else []
        if not offered or mine[first_block:first_block + offered] != list(block_hashes):
            return KVImportResult(offered, 0, 0, offered)
        present = max(0, min(self.kv.num_cached_prompt_blocks(namespace, token_ids), first_block + offered)
                      - first_block)
        pending = self.kv.begin_import(namespace, token_ids, first_block, offered)
        if pending is None:
            return KVImportResult(offered, 0, present, offered - present)
        from kvserve.engine.kv.tensors import write_kv_blocks
        skip = pending.num_present - first_block
        try:
            write_kv_blocks(self._kv_tensor(), pending.block_ids, kv[:, :, skip:skip + len(pending.block_ids)])
        except BaseException:
            self.kv.cancel_import(pending)
            raise
        self.kv.finish_import(pending, grace_s)
        imported = len(pending.block_ids)
        return KVImportResult(offered, imported, skip, offered - skip - imported)

    def _kv_tensor(self):
        kv_cache = getattr(self.runner, "kv_cache", None)
        if kv_cache is None or self.config.tensor_parallel_size > 1:      # rank 0 holds only its heads
            raise NotImplementedError(f"{type(self.runner).__name__} has no single KV tensor to move blocks of")
        return kv_cache

    # ----------------------------------------------------------------- status
    def check_integrity(self) -> None:
        """free + cached-only + in use == total; every reference is held by a live
        sequence or the prefix cache; the cache tree and its locks are sound."""
        self.scheduler.check_integrity()

    def spec_stats(self) -> dict | None:
        """Speculation counters (proposed, accepted, per position, mean accepted length,
        steps on/off), or None when speculation is off."""
        return self.speculator.stats()

    def _largest_subtrees(self) -> list[PrefixSubtree]:
        """The prefix cache's largest branches, walked at most once per SUBTREES_REFRESH_S
        while requests run (stats are taken every step; the walk visits every node), and
        afresh when idle (the last picture before a pause is the one that stays up)."""
        cache = self.kv.prefix_cache
        if cache is None:
            return []
        now = time.monotonic()
        if now - self._subtrees_at >= SUBTREES_REFRESH_S or not self.has_unfinished():
            self._subtrees, self._subtrees_at = cache.largest_subtrees(SUBTREES_SHOWN), now
        return self._subtrees

    def stats(self) -> EngineStats:
        """Gauges and counters for metrics: sequences, KV blocks, preemptions, steps, the
        prefix cache's queries and hits, speculation, the step-time fit, and (fair sharing
        on) the tokens computed per tenant."""
        cache, pool = self.kv.cache_stats(), self.kv.block_pool
        fit = self.step_time.coefficients()
        return EngineStats(
            num_running_seqs=self.scheduler.num_running, num_waiting_seqs=self.scheduler.num_waiting,
            kv_blocks_used=pool.num_used_blocks, kv_blocks_cached=pool.num_cached_only_blocks,
            kv_blocks_total=pool.num_blocks, kv_cache_dtype=self.kv_cache_dtype, num_preemptions=self.scheduler.num_preemptions,
            num_steps=self.num_steps, step_seconds=self.step_clock.wall_s, step_cpu_seconds=self.step_clock.cpu_s,
            prefix_cache_enabled=cache is not None,
            prefix_cache_queries=cache.num_queries if cache else 0,
            prefix_cache_query_tokens=cache.num_query_tokens if cache else 0,
            prefix_cache_hit_tokens=cache.num_hit_tokens if cache else 0,
            prefix_cache_hit_rate=cache.hit_rate if cache else 0.0,
            prefix_cache_evicted_blocks=cache.num_evicted_blocks if cache else 0,
            prefix_cache_blocks=cache.num_cached_blocks if cache else 0,
            prefix_cache_subtrees=self._largest_subtrees(),
            speculation=self.speculator.counters(),
            step_time_fixed_s=fit[0] if fit else 0.0, step_time_per_token_s=fit[1] if fit else 0.0,
            adapters=self.adapters.counters() if self.adapters is not None else AdapterCounters(),
            parallel=self.runner.parallel_counters(),
            tenant_served_tokens=tenant_served_tokens(self.scheduler.policy))
