"""Draft-model proposer: a smaller model (or the target's first layers) proposes k
tokens autoregressively on the same paged KV layout and block ids as the target.

Two ways to hold the draft's KV:

- ``self:<layers>``: the draft *is* the target's first layers, so their KV is the
  target's own (the same weights on the same tokens): the draft reads the target's
  cache tensor for those layers and only computes the sequence's last token and
  its drafts. Nothing extra to allocate.
- ``draft:<model>``: its own cache ``[draft layers, 2, blocks, ...]`` (in the target's KV
  dtype, 8-bit formats included) indexed
  by the target's block ids (a block id covers both), so the block pool's
  accounting covers both models. The draft mirrors every token the target
  computes (one extra draft forward per step), so prefix-cached blocks carry draft
  KV too.

Draft tokens: greedy rows take the draft's argmax; seeded sampled rows race the
draft's distribution against the very noise the target will draw at that position
(coupled, so they agree whenever the two distributions nearly do); unseeded
sampled rows sample the draft distribution and keep it for rejection sampling.
"""
from __future__ import annotations

import copy
import time

import torch
from torch import nn

from kvserve.engine.kv.tensors import allocate_kv_tensors, cache_kv_dtype
from kvserve.engine.model_runner import ModelRunner
from kvserve.engine.sequence import token_slice
from kvserve.engine.step import ScheduledSeq, StepPlan
from kvserve.errors import InvalidRequestError
from kvserve.sampling.sampler import SamplingRow, seeded_exponentials
from kvserve.speculative.proposer import Draft, ProposerContext
from kvserve.speculative.verify import target_distributions


def truncated_model(model: nn.Module, num_layers: int) -> nn.Module:
    """A view of ``model`` running only its first ``num_layers`` decoder layers (then
    its final norm and head); parameters are shared, nothing is copied. A model that wraps
    another (a tensor-parallel shard) truncates itself (its ``truncated``)."""
    if not 1 <= num_layers <= len(model.layers):
        raise ValueError(f"self-draft layers must be in [1, {len(model.layers)}], got {num_layers}")
    if hasattr(model, "truncated"):
        return model.truncated(num_layers)
    view = copy.copy(model)
    view._modules = dict(model._modules)
    view._modules["layers"] = nn.ModuleList(list(model.layers)[:num_layers])
    return view


class DraftModelProposer:
    """Proposes each speculating sequence's lookahead tokens with a draft model."""

    uses_model = True            # draft passes cost time: the controller models them

    def __init__(self, model: nn.Module, kv_cache: torch.Tensor, backend, block_size: int,
                 device: torch.device, shares_target_kv: bool, seed: int = 0, runner_factory=ModelRunner):
        # runner_factory: a tensor-parallel self-draft's runner also drives the other ranks
        self.runner = runner_factory(model, kv_cache, backend, block_size, device)
        self.shares_target_kv = shares_target_kv
        self.device = device
        self._computed: dict[int, int] = {}          # seq_id -> positions with draft KV (own KV only)
        self._generator = torch.Generator(device=device)
        self._generator.manual_seed(seed)
        self.pass_times: list[tuple[int, float]] = []   # (sequences, seconds) of this step's draft passes

    @torch.inference_mode()
    def propose(self, plan: StepPlan) -> dict[int, Draft]:
        """Run the draft passes for this plan: a Draft per sequence with lookahead slots
        (its distributions kept for unseeded sampled rows). With its own KV the draft
        also mirrors every token the target computes this step."""
        self.pass_times = []
        if not self.shares_target_kv:
            self.runner.copy_blocks(plan.block_copies)
        speculating = [s for s in plan.scheduled if s.num_lookahead_slots > 0]
        first = [self._catch_up(s) for s in plan.scheduled
                 if s.num_lookahead_slots > 0 or not self.shares_target_kv]
        if not speculating:
            if first:
                self._timed_forward(StepPlan(first))   # mirror the target's KV only
            return {}
        drafts: dict[int, list[int]] = {s.seq_id: [] for s in speculating}
        probs: dict[int, list[torch.Tensor]] = {s.seq_id: [] for s in speculating}
        self._draw(speculating, self._timed_forward(StepPlan(first)), drafts, probs)
        for j in range(1, max(s.num_lookahead_slots for s in speculating)):
            active = [s for s in speculating if s.num_lookahead_slots > j]
            step = StepPlan([self._draft_step(s, drafts[s.seq_id][-1], j) for s in active])
            self._draw(active, self._timed_forward(step), drafts, probs)
        return {s.seq_id: Draft(drafts[s.seq_id], torch.stack(probs[s.seq_id]) if probs[s.seq_id] else None)
                for s in speculating}

    @torch.inference_mode()
    def on_step_done(self, plan: StepPlan, accepted_counts: dict[int, int], finished_seq_ids) -> None:
        """Record how far each sequence's draft KV is valid once verification is known:
        the real tokens, plus the accepted drafts the draft itself computed. The last
        draft is never fed back; if it was accepted, a live sequence's next pass 1
        computes it, and a sequence that just finished gets it computed now, so the
        blocks it leaves in the prefix cache carry complete draft KV. Ended sequences
        are dropped afterwards by :meth:`forget`."""
        finished = set(finished_seq_ids)
        holes = []
        if not self.shares_target_kv:
            for s in plan.scheduled:
                if s.lookahead_token_ids:
                    end = s.start_position + len(s.token_ids)
                    written = len(s.lookahead_token_ids) - 1          # the last draft was never fed back
                    accepted = accepted_counts.get(s.seq_id, 0)
                    self._computed[s.seq_id] = end + min(accepted, written)
                    if s.seq_id in finished and accepted > written:
                        holes.append(ScheduledSeq(s.seq_id, [s.lookahead_token_ids[-1]], end + written, s.block_table,
                                                  False, s.params, s.prompt_token_ids, s.output_token_ids,
                                                  s.eos_token_ids, s.sibling_index))
        if holes:     # the blocks are free or cached now, and nobody reallocates them before the next step
            self.runner.forward_logits(StepPlan(holes))

    def forget(self, seq_ids) -> None:
        """Drop the draft-KV records of sequences that ended or restart from scratch."""
        for seq_id in seq_ids:
            self._computed.pop(seq_id, None)

    def tracked_seq_ids(self) -> set[int]:
        """Sequences with a draft-KV record (own KV only)."""
        return set(self._computed)

    # ---------------------------------------------------------------- internals
    def _catch_up(self, s: ScheduledSeq) -> ScheduledSeq:
        """Pass-1 work for ``s``: every token the draft has not computed up to the end
        of this step's real tokens (just those tokens when the KV is shared)."""
        end = s.start_position + len(s.token_ids)
        start = s.start_position
        if not self.shares_target_kv:
            start = min(self._computed.get(s.seq_id, start), start)
            self._computed[s.seq_id] = end
        tokens = (s.token_ids if start == s.start_position
                  else token_slice(s.prompt_token_ids, s.output_token_ids, start, end))
        return ScheduledSeq(s.seq_id, list(tokens), start, s.block_table, s.num_lookahead_slots > 0, s.params,
                            s.prompt_token_ids, s.output_token_ids, s.eos_token_ids, s.sibling_index)

    @staticmethod
    def _draft_step(s: ScheduledSeq, token: int, j: int) -> ScheduledSeq:
        """Feed draft ``j`` (0-based ``j - 1``-th proposal) back at its position."""
        position = s.start_position + len(s.token_ids) + j - 1
        return ScheduledSeq(s.seq_id, [token], position, s.block_table, True, s.params,
                            s.prompt_token_ids, s.output_token_ids, s.eos_token_ids, s.sibling_index)

    def _timed_forward(self, plan: StepPlan) -> torch.Tensor | None:
        started = time.perf_counter()
        logits = self.runner.forward_logits(plan)
        self.pass_times.append((sum(1 for s in plan.scheduled if s.sample), time.perf_counter() - started))
        return logits

    def _draw(self, seqs: list[ScheduledSeq], logits: torch.Tensor, drafts, probs) -> None:
        """One draft token per sequence from its row of ``logits`` (see the module doc)."""
        rows = [SamplingRow(s.params, s.prompt_token_ids, list(s.output_token_ids) + drafts[s.seq_id],
                            s.eos_token_ids, s.sibling_index) for s in seqs]
        dist = target_distributions(logits, rows)                        # [S, V]
        vocab = dist.shape[1]
        for i, (s, row) in enumerate(zip(seqs, rows)):
            if s.params.is_greedy:
                token = int(dist[i].argmax())
            else:
                if s.params.seed is not None:
                    noise = seeded_exponentials(row, vocab, self.device)
                else:
                    noise = torch.empty(vocab, device=self.device).exponential_(generator=self._generator)
                    noise.clamp_min_(torch.finfo(noise.dtype).tiny)
                    probs[s.seq_id].append(dist[i])
                token = int((dist[i] / noise).argmax())
            drafts[s.seq_id].append(token)



def build_self_draft(ctx: ProposerContext) -> DraftModelProposer:
    """``self:<layers>``: the target's first layers, reading the target's own KV for them."""
    from kvserve.attention import get_backend

    layers, mc = ctx.spec.draft_layers, ctx.target_config
    if layers > mc.num_layers:
        raise InvalidRequestError(f"self:{layers}: the model has {mc.num_layers} layers", param="speculative")
    backend = get_backend(ctx.attention_backend, mc.num_heads, mc.num_kv_heads, mc.head_dim)
    factory = ctx.sharded_runner(layers) if ctx.sharded_runner else ModelRunner
    return DraftModelProposer(truncated_model(ctx.target_model, layers), ctx.kv_cache[:layers], backend,
                              ctx.block_size, ctx.device, shares_target_kv=True, seed=ctx.seed,
                              runner_factory=factory)


def build_draft_model(ctx: ProposerContext) -> DraftModelProposer:
    """``draft:<model>``: a second model with its own KV tensor indexed by the target's
    block ids. Its vocabulary must be the target's (the drafts are target token ids)."""
    from kvserve.attention import get_backend

    dc = ctx.draft_model.config
    if dc.vocab_size != ctx.target_config.vocab_size:
        raise InvalidRequestError(
            f"the draft model's vocabulary ({dc.vocab_size}) differs from the target's "
            f"({ctx.target_config.vocab_size}): a draft must share the tokenizer", param="speculative")
    draft_kv = allocate_kv_tensors(dc.num_layers, ctx.num_blocks, ctx.block_size, dc.num_kv_heads, dc.head_dim,
                                   cache_kv_dtype(ctx.kv_cache), ctx.dtype, ctx.device)   # the target's KV dtype
    backend = get_backend(ctx.attention_backend, dc.num_heads, dc.num_kv_heads, dc.head_dim)
    return DraftModelProposer(ctx.draft_model, draft_kv, backend, ctx.block_size, ctx.device,
                              shares_target_kv=False, seed=ctx.seed)
