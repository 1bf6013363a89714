"""Engine core: owns the model, the KV cache, the block pool and the scheduler.

It sees token ids and SamplingParams only (no HTTP, JSON, chat templates or text).
One ``step()`` is the DESIGN.md step contract:
``plan = scheduler.schedule(); result = runner.execute(plan); scheduler.update(plan, result)``.
The prefix cache (``engine/prefix_cache.py``) lives beside the block pool and is driven
by the scheduler; here requests get their cache namespace and the cache its admin calls.
"""
from __future__ import annotations

import itertools
import logging
import math
from dataclasses import dataclass

import torch

from kvserve.engine.kv.block_pool import BlockPool
from kvserve.engine.kv.tensors import allocate_kv_cache, default_kv_budget_bytes, plan_kv_cache
from kvserve.engine.model_runner import ModelRunner
from kvserve.engine.kv.prefix_cache import PrefixCache
from kvserve.engine.kv.cache_events import CacheEvent, CacheNamespace
from kvserve.engine.scheduler import Scheduler, SchedulerConfig
from kvserve.engine.sequence import FinishReason, Sequence
from kvserve.engine.step import SeqUpdate
from kvserve.errors import ContextLengthExceededError, InvalidRequestError
from kvserve.engine.kv.sizing import kv_bytes_per_token as planner_kv_bytes_per_token
from kvserve.sampling.params import SamplingParams
from kvserve.speculative.config import SpeculativeConfig
from kvserve.speculative.controller import SpecController

logger = logging.getLogger("kvserve.engine")


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


def _spec_config(value) -> SpeculativeConfig | None:
    """EngineConfig.speculative as a SpeculativeConfig (None: off)."""
    if value is None or value == "" or isinstance(value, SpeculativeConfig):
        return value or None
    if isinstance(value, dict):
        return SpeculativeConfig(**value)
    return SpeculativeConfig.parse(str(value))


def kv_bytes_per_token(config, dtype: torch.dtype) -> int:
    """KV bytes one token takes in every layer of ``config``'s model (the planner's formula)."""
    return int(planner_kv_bytes_per_token(config.num_layers, config.num_kv_heads, config.head_dim,
                                          torch.empty((), dtype=dtype).element_size()))


def resolve_device_dtype(device: str, dtype: str) -> tuple[torch.device, torch.dtype]:
    """Pick the device and the compute dtype: fp32 on CPU, bf16 on GPU unless told otherwise."""
    dev = torch.device("cuda" if device == "auto" and torch.cuda.is_available() else
                       ("cpu" if device == "auto" else device))
    if dtype == "auto":
        return dev, (torch.bfloat16 if dev.type == "cuda" else torch.float32)
    names = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16,
             "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16}
    if dtype not in names:
        raise InvalidRequestError(f"unknown dtype {dtype!r}; choose from {sorted(names)}", param="dtype")
    return dev, names[dtype]


class EngineCore:
    """The offline engine: add requests, call ``step()`` until nothing is unfinished."""

    def __init__(self, config: EngineConfig, checkpoint=None):
        from kvserve.attention import get_backend
        from kvserve.loader import load_checkpoint
        from kvserve.models.registry import build_model
        from kvserve.sampling.sampler import Sampler

        self.config = config
        if not 0 <= config.prefix_cache_grace_s < math.inf:
            raise InvalidRequestError("prefix_cache_grace_s must be a finite number >= 0",
                                      param="prefix_cache_grace_s")
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        self.device, self.dtype = resolve_device_dtype(config.device, config.dtype)
        checkpoint = checkpoint or load_checkpoint(config.model)
        self.model_config = mc = checkpoint.config
        model = build_model(mc)
        model.load_weights(checkpoint.tensors)
        del checkpoint
        model = model.to(device=self.device, dtype=self.dtype).eval()
        model.rotary.float()                            # rotary tables stay fp32
        self.weight_layouts = model.pack_weights()
        self.weight_bytes = model.weight_bytes()
        self.decode_read_bytes = model.decode_read_bytes()
        logger.info("weights: %.1f MB (%.1f MB read per decode step), layouts %s", self.weight_bytes / 1e6,
                    self.decode_read_bytes / 1e6, self.weight_layouts)
        self.max_model_len = min(config.max_model_len or mc.max_position_embeddings,
                                 mc.max_position_embeddings)
        self.spec_config = _spec_config(config.speculative)
        draft = self._load_draft_model(model) if self.spec_config and self.spec_config.method == "draft" else None
        budget = config.kv_cache_bytes or default_kv_budget_bytes(self.device, self.weight_bytes)
        if draft is not None:       # one block id covers target and draft KV: split the budget
            target_bpt, draft_bpt = (kv_bytes_per_token(c, self.dtype) for c in (mc, draft.config))
            budget = budget * target_bpt // (target_bpt + draft_bpt)
        self.kv_plan = plan_kv_cache(mc, budget, self.dtype, config.block_size, self.max_model_len)
        if self.kv_plan.num_blocks < 1:
            raise InvalidRequestError(f"KV budget of {budget} bytes holds no block: {self.kv_plan.explanation}",
                                      param="kv_cache_bytes")
        logger.info("KV cache: %s", self.kv_plan.explanation)
        kv_cache = allocate_kv_cache(mc, self.kv_plan, self.dtype, self.device)
        self.block_pool = BlockPool(self.kv_plan.num_blocks, config.block_size)
        self.prefix_cache = PrefixCache(self.block_pool) if config.enable_prefix_cache else None
        self.weight_epoch = 0
        self.spec_controller = (SpecController(self.spec_config.num_speculative_tokens, self.spec_config.min_gain,
                                               self.spec_config.max_batch_size,
                                               uses_draft_model=self.spec_config.method != "ngram")
                                if self.spec_config else None)
        self.scheduler = Scheduler(SchedulerConfig(config.max_num_seqs, config.max_num_batched_tokens,
                                                   config.prefix_cache_grace_s),
                                   self.block_pool, self.prefix_cache, self.spec_controller, self.max_model_len)
        backend = get_backend(config.attention_backend, mc.num_heads, mc.num_kv_heads, mc.head_dim)
        self.runner = ModelRunner(model, kv_cache, backend, config.block_size, self.device,
                                  Sampler(seed=config.seed), seed=config.seed)
        self.proposer = self._build_proposer(model, kv_cache, draft) if self.spec_config else None
        self._seq_ids = itertools.count()
        self._arrivals = itertools.count()
        self.num_steps = 0

    # ---------------------------------------------------------------- requests
    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                    eos_token_ids: frozenset[int] | None = None, priority: int = 0, *,
                    cache_salt: str | None = None, adapter_id: str | None = None,
                    use_prefix_cache: bool = True, prefix_cache_grace_s: float | None = None,
                    num_speculative_tokens: int | None = None) -> None:
        """Validate and queue a request; ``params.n`` sequences share its prompt blocks.

        Prefix caching: the request reads and writes KV blocks of the namespace
        (``adapter_id``, current weight epoch, ``cache_salt``). ``cache_salt`` must be
        derived from the authenticated caller, never copied from a request body, so
        tenants never share blocks; ``adapter_id`` only namespaces the cache today.
        ``use_prefix_cache=False`` opts this request out (no reads, no writes).
        ``prefix_cache_grace_s`` overrides ``EngineConfig.prefix_cache_grace_s`` for this
        request: how long its blocks stay unevictable after it finishes (a conversation
        turn whose next message is expected).
        ``num_speculative_tokens`` caps this request's drafts per step (0 = do not
        speculate; None = the engine's setting); ignored when speculation is off.
        """
        prompt = list(prompt_token_ids)
        self.validate_request(prompt, params)
        if prefix_cache_grace_s is not None and not 0 <= prefix_cache_grace_s < math.inf:
            raise InvalidRequestError("prefix_cache_grace_s must be a finite number >= 0",
                                      param="prefix_cache_grace_s")
        max_tokens = params.max_tokens if params.max_tokens is not None else self.max_model_len - len(prompt)
        eos = frozenset(self.model_config.eos_token_ids) if eos_token_ids is None else frozenset(eos_token_ids)
        arrival = next(self._arrivals)
        namespace = (CacheNamespace(adapter_id, self.weight_epoch, cache_salt)
                     if self.prefix_cache is not None and use_prefix_cache and params.prompt_logprobs is None
                     else None)      # prompt logprobs need every prompt position computed

        def make(sibling: int) -> Sequence:
            return Sequence(seq_id=next(self._seq_ids), request_id=request_id, sibling_index=sibling,
                            prompt_token_ids=prompt, params=params, max_tokens=max_tokens,
                            eos_token_ids=eos, priority=priority, arrival_index=arrival,
                            cache_namespace=namespace, cache_grace_s=prefix_cache_grace_s,
                            num_speculative_tokens=num_speculative_tokens)

        leader = make(0)
        leader.pending_fork = [make(i) for i in range(1, params.n)]
        self.scheduler.add_sequence(leader)

    def validate_request(self, prompt: list[int], params: SamplingParams) -> None:
        """Raise a typed error if this request cannot run here; changes nothing."""
        params.validate()
        if not prompt:
            raise InvalidRequestError("the prompt is empty", param="prompt")
        vocab = self.model_config.vocab_size
        if any((not isinstance(t, int)) or t < 0 or t >= vocab for t in prompt):
            raise InvalidRequestError(f"prompt token ids must be integers in [0, {vocab})", param="prompt")
        if params.logit_bias and max(params.logit_bias) >= vocab:
            raise InvalidRequestError(f"logit_bias token id {max(params.logit_bias)} is outside the "
                                      f"vocabulary [0, {vocab})", param="logit_bias")
        if len(prompt) >= self.max_model_len:
            raise ContextLengthExceededError(
                f"the prompt has {len(prompt)} tokens; this model's context is {self.max_model_len} tokens "
                f"and at least one must be left to generate", param="prompt")
        if params.max_tokens is not None and len(prompt) + params.max_tokens > self.max_model_len:
            raise ContextLengthExceededError(
                f"prompt ({len(prompt)} tokens) + max_tokens ({params.max_tokens}) = "
                f"{len(prompt) + params.max_tokens} exceeds the context of {self.max_model_len} tokens",
                param="max_tokens")
        max_seq_blocks = math.ceil(self.max_model_len / self.config.block_size)
        if self.block_pool.num_blocks < min(max_seq_blocks, math.ceil(
                (len(prompt) + (params.max_tokens or 0)) / self.config.block_size)):
            raise ContextLengthExceededError(
                f"the KV cache ({self.kv_plan.max_tokens} tokens) cannot hold this request", param="prompt")

    def abort_request(self, request_id: str) -> list[SeqUpdate]:
        """Abort every sequence of a request now; their blocks are freed at once."""
        updates = self.scheduler.abort_request(request_id)
        self._forget([u.seq_id for u in updates])
        return updates

    def stop_sequence(self, seq_id: int) -> None:
        """Finish one sequence with reason ``stop`` (the front end matched a stop string)."""
        self.scheduler.finish_sequence(seq_id, FinishReason.STOP)
        self._forget([seq_id])

    # -------------------------------------------------------------------- step
    def step(self) -> list[SeqUpdate]:
        """One engine step; returns what each sequence produced."""
        plan = self.scheduler.schedule()
        speculating = self.proposer is not None and not plan.is_empty
        if speculating:
            self.proposer.propose(plan)
        result = self.runner.execute(plan, draft_probs=self.proposer.draft_probs if speculating else None)
        self.num_steps += 1
        updates = self.scheduler.update(plan, result)
        if speculating:
            self._learn(plan, result, updates)
        return updates

    def _learn(self, plan, result, updates: list[SeqUpdate]) -> None:
        """Feed step times and verification outcomes to the speculation controller."""
        controller = self.spec_controller
        controller.observe_step(plan.num_tokens, result.forward_time_s)
        for num_seqs, seconds in self.proposer.pass_times:
            controller.observe_draft_pass(num_seqs, seconds)
        for u in updates:
            if u.num_draft_proposed:
                controller.observe_verification(u.seq_id, u.num_draft_proposed, u.num_draft_accepted)
        accepted = {seq_id: len(tokens) for seq_id, tokens in result.accepted_drafts.items()}
        finished = [u.seq_id for u in updates if u.finish_reason is not None]
        self.proposer.on_step_done(plan, accepted, finished)
        self._forget(finished + plan.preempted_seq_ids)

    def _forget(self, seq_ids: list[int]) -> None:
        """Drop speculation state of sequences that ended or restart from scratch."""
        if self.proposer is not None and seq_ids:
            self.proposer.forget(seq_ids)
            for seq_id in seq_ids:
                self.spec_controller.forget(seq_id)

    # ------------------------------------------------------------ speculation
    def _load_draft_model(self, target):
        """The ``draft:<model>`` checkpoint, on the target's device and dtype; its
        vocabulary must be the target's (the drafts are target token ids)."""
        from kvserve.loader import load_checkpoint
        from kvserve.models.registry import build_model

        checkpoint = load_checkpoint(self.spec_config.draft_model)
        if checkpoint.config.vocab_size != self.model_config.vocab_size:
            raise InvalidRequestError(
                f"the draft model's vocabulary ({checkpoint.config.vocab_size}) differs from the target's "
                f"({self.model_config.vocab_size}): a draft must share the tokenizer", param="speculative")
        draft = build_model(checkpoint.config)
        draft.load_weights(checkpoint.tensors)
        draft = draft.to(device=self.device, dtype=self.dtype).eval()
        draft.rotary.float()
        draft.pack_weights()
        return draft

    def _build_proposer(self, model, kv_cache: torch.Tensor, draft):
        from kvserve.attention import get_backend
        from kvserve.speculative.draft import DraftModelProposer, truncated_model
        from kvserve.speculative.ngram import NgramProposer

        spec, cfg = self.spec_config, self.config
        if spec.method == "ngram":
            return NgramProposer(spec.ngram_max, spec.ngram_min)
        if spec.method == "self":
            layers = spec.draft_layers
            if layers > self.model_config.num_layers:
                raise InvalidRequestError(f"self:{layers}: the model has {self.model_config.num_layers} layers",
                                          param="speculative")
            return DraftModelProposer(truncated_model(model, layers), kv_cache[:layers], self.runner.backend,
                                      cfg.block_size, self.device, shares_target_kv=True, seed=cfg.seed)
        dc = draft.config
        draft_kv = torch.zeros((dc.num_layers, 2, self.kv_plan.num_blocks, cfg.block_size, dc.num_kv_heads,
                                dc.head_dim), dtype=self.dtype, device=self.device)
        backend = get_backend(cfg.attention_backend, dc.num_heads, dc.num_kv_heads, dc.head_dim)
        return DraftModelProposer(draft, draft_kv, backend, cfg.block_size, self.device,
                                  shares_target_kv=False, seed=cfg.seed)

    def spec_stats(self) -> dict | None:
        """Speculation counters (proposed, accepted, per position, mean accepted length,
        steps on/off), or None when speculation is off."""
        return self.spec_controller.stats.as_dict() if self.spec_controller else None

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def check_integrity(self) -> None:
        """free + cached-only + in use == total; every reference is held by a live
        sequence or the prefix cache; the cache tree and its locks are sound."""
        self.scheduler.check_integrity()

    # ------------------------------------------------------------ prefix cache
    def reset_prefix_cache(self) -> int:
        """Admin: drop every cached block no running request uses (grace ignored);
        returns how many. Authentication is the caller's job."""
        return self.scheduler.reset_prefix_cache()

    def bump_weight_epoch(self) -> int:
        """Call after reloading weights: new requests use a new cache namespace, so no
        block computed with older weights is matched again; the older epochs' unlocked
        blocks are dropped now, the rest when their requests finish and LRU reaches them."""
        self.weight_epoch += 1
        if self.prefix_cache is not None:
            epoch = self.weight_epoch
            self.prefix_cache.evict_namespaces(lambda ns: ns.weight_epoch < epoch)
        return self.weight_epoch

    def drain_cache_events(self) -> list[CacheEvent]:
        """Block stored / removed events since the last drain (for a cache-aware router)."""
        return self.prefix_cache.drain_events() if self.prefix_cache is not None else []

    def stats(self) -> dict[str, int | float]:
        """Gauges and counters for metrics: running/waiting sequences, KV blocks (in use by
        requests, cached-only, total), preemptions, steps, and the prefix cache's queries,
        hit tokens, hit rate and evicted blocks (zeros when the cache is off)."""
        cache = self.prefix_cache.stats() if self.prefix_cache is not None else None
        return {
            "num_running_seqs": self.scheduler.num_running,
            "num_waiting_seqs": self.scheduler.num_waiting,
            "kv_blocks_used": self.block_pool.num_used_blocks,
            "kv_blocks_cached": self.block_pool.num_cached_only_blocks,
            "kv_blocks_total": self.block_pool.num_blocks,
            "num_preemptions": self.scheduler.num_preemptions,
            "num_steps": self.num_steps,
            "prefix_cache_enabled": int(cache is not None),
            "prefix_cache_queries": cache.num_queries if cache else 0,
            "prefix_cache_query_tokens": cache.num_query_tokens if cache else 0,
            "prefix_cache_hit_tokens": cache.num_hit_tokens if cache else 0,
            "prefix_cache_hit_rate": cache.hit_rate if cache else 0.0,
            "prefix_cache_evicted_blocks": cache.num_evicted_blocks if cache else 0,
            "prefix_cache_blocks": cache.num_cached_blocks if cache else 0,
            **self._spec_stats_flat(),
        }

    def _spec_stats_flat(self) -> dict:
        spec = self.spec_stats()
        if spec is None:
            return {"spec_enabled": 0}
        return {"spec_enabled": 1, "spec_num_proposed": spec["num_proposed"],
                "spec_num_accepted": spec["num_accepted"], "spec_num_verifications": spec["num_verifications"],
                "spec_num_steps_on": spec["num_steps_on"], "spec_num_steps_off": spec["num_steps_off"],
                "spec_accepted_per_position": spec["accepted_per_position"]}
