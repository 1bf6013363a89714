"""Model runner: StepPlan -> tensors -> forward -> sampled tokens (StepResult).

Owns the model, the KV cache tensor and the sampler. Never mutates scheduler
state: everything it needs arrives in the plan as ints and lists. A ``BatchContext``
(LoRA segments) orders the plan's sequences and brackets each forward with the
metadata the model's projection transforms read. Structured output: the injected
constraints (``engine/constraint.py``) give grammar masks for the constrained sampling
rows, filled on the host after the forward is launched (overlapping a GPU's kernels); the
sampler applies them to those rows only. On a GPU, decode-only steps replay CUDA graphs
(``engine/cuda_graphs.py``, injected by the builder) instead of launching each kernel.
"""
from __future__ import annotations

import time

import torch

from kvserve.attention import AttentionMetadata, DecodeGroup, PrefillChunk
from kvserve.engine.batch_context import BatchContext, PlainBatch
from kvserve.engine.constraint import ConstraintMasks, NullConstraints
from kvserve.engine.decode_groups import decode_groups
from kvserve.engine.lookahead import LookaheadGroup, Verifier
from kvserve.engine.stats import ParallelCounters
from kvserve.engine.step import ForwardWork, SampledToken, ScheduledSeq, StepPlan, StepResult
from kvserve.sampling.sampler import Sampler, SamplingRow, token_logprobs


class ModelRunner:
    """Executes step plans on one device."""

    def __init__(self, model, kv_cache: torch.Tensor, backend, block_size: int,
                 device: torch.device, sampler: Sampler | None = None, verifier: Verifier | None = None,
                 batch_context: BatchContext | None = None, constraints=None, decode_graphs=None):
        self.model = model
        self.kv_cache = kv_cache           # [layers, 2, blocks, block_size, KVH, D]
        self.backend = backend
        self.block_size = block_size
        self.device = device
        self.sampler = sampler or Sampler()
        self.verifier = verifier           # settles lookahead tokens (None: plans never carry any)
        self.batch_context = batch_context or PlainBatch()
        self.constraints = constraints or NullConstraints()   # grammar masks (structured output)
        self.decode_graphs = decode_graphs  # kvserve.engine.cuda_graphs.DecodeGraphs, or None (eager)

    @torch.inference_mode()
    def execute(self, plan: StepPlan) -> StepResult:
        """Run one step: KV block copies, one forward over all scheduled tokens (lookahead
        tokens included), sampling, and verification of lookahead tokens by the verifier."""
        started = time.perf_counter()
        self.copy_blocks(plan.block_copies)
        if plan.is_empty:
            return StepResult()
        items = self.batch_context.order(plan.scheduled)
        to_sample = [s for s in items if s.sample]
        hidden, sample_rows = self._forward(items)
        # grammar masks are host work on the sequences' tokens: filled once the forward is
        # launched, so on a GPU they overlap its (asynchronous) kernels; on CPU it is serial
        masks = self.constraints.masks(to_sample, self.device)
        prompt_lps = self._prompt_logprobs(items, hidden)
        if not to_sample:
            return StepResult(prompt_logprobs=prompt_lps, forward_time_s=time.perf_counter() - started)
        logits = self.project(hidden, sample_rows)                                # [rows, vocab]
        rows, groups = self._sampling_rows(to_sample, masks)
        if groups:
            samples, accepted, final = self.verifier(logits, rows, groups)
        else:
            out = self.sampler(logits, rows)
            samples = [SampledToken(t, lp, top) for t, lp, top in zip(out.token_ids, out.logprobs, out.top_logprobs)]
            accepted, final = {}, {}
        sampled, row = {}, 0
        for s in to_sample:
            sampled[s.seq_id] = final[s.seq_id] if s.lookahead_token_ids else samples[row]
            row += len(s.lookahead_token_ids) + 1
        return StepResult(sampled=sampled, accepted_lookahead=accepted, prompt_logprobs=prompt_lps,
                          forward_time_s=time.perf_counter() - started)

    @staticmethod
    def _sampling_rows(to_sample, masks: ConstraintMasks | None = None
                       ) -> tuple[list[SamplingRow], list[LookaheadGroup]]:
        """One row per sampled position: the token after the last real one, then the token
        after each lookahead token (penalties see the earlier lookahead tokens as output);
        constrained rows carry their grammar mask."""
        rows, groups = [], []
        for s in to_sample:
            if s.lookahead_token_ids:
                groups.append(LookaheadGroup(s.seq_id, len(rows), list(s.lookahead_token_ids)))
            for j in range(len(s.lookahead_token_ids) + 1):
                output = s.output_token_ids if j == 0 else list(s.output_token_ids) + s.lookahead_token_ids[:j]
                rows.append(SamplingRow(params=s.params, prompt_token_ids=s.prompt_token_ids,
                                        output_token_ids=output, eos_token_ids=s.eos_token_ids,
                                        seed_offset=s.sibling_index))
        if masks is not None:
            for i, row in enumerate(masks.rows):
                rows[row].allowed = masks.allowed[i]
        return rows, groups

    def forward_logits(self, plan: StepPlan) -> torch.Tensor | None:
        """One forward over the plan's tokens (lookahead included); fp32 logits of the
        sampled rows, ``[rows, vocab]`` in the batch context's order (plan order without
        one; None if nothing samples)."""
        hidden, sample_rows = self._forward(self.batch_context.order(plan.scheduled))
        if sample_rows.numel() == 0:
            return None
        return self.project(hidden, sample_rows)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """fp32 logits ``[rows, vocab]`` of final hidden states ``[rows, hidden]`` (the one
        place the runner projects onto the vocabulary)."""
        return self.model.compute_logits(hidden)

    def project(self, hidden: torch.Tensor, rows) -> torch.Tensor:
        """fp32 logits of rows ``rows`` (an index tensor or a slice) of the last forward's
        ``hidden``: a tensor-parallel runner names the rows and its ranks project their own
        copies of the hidden states (the same bits on every rank) instead of receiving them."""
        return self.logits(hidden[rows])

    @torch.inference_mode()
    def warm_up(self, prompt_tokens: int = 16) -> float:
        """One prefill of ``prompt_tokens`` tokens and one single-token decode through the
        model and the vocabulary head, on KV blocks from 0 (free at start: whatever they
        hold is overwritten before any request reads it), so the first request does not
        pay the kernels' first-use costs. Returns the seconds it took."""
        started = time.perf_counter()
        prompt_tokens = max(1, min(prompt_tokens, self.kv_cache.shape[2] * self.block_size - 1))
        blocks = list(range(-(-(prompt_tokens + 1) // self.block_size)))
        prefill = ForwardWork(list(range(1, prompt_tokens + 1)), 0, blocks, True)
        decode = ForwardWork([1], prompt_tokens, blocks, True)
        for work in (prefill, decode):
            hidden, rows = self._forward([work])
            self.project(hidden, rows)
        return time.perf_counter() - started

    def parallel_counters(self) -> ParallelCounters:
        """Expert load of a mixture-of-experts model on this process (one rank: no collectives)."""
        expert_load = getattr(self.model, "expert_load", None)          # MoE models only
        if expert_load is None:
            return ParallelCounters()
        return expert_counters(list(self.model.sparse_blocks().values()), [])

    def close(self) -> None:
        """Release what the runner started (nothing here; ranks of a parallel runner)."""

    def _forward(self, items: list[ScheduledSeq]) -> tuple[torch.Tensor, torch.Tensor]:
        """Final hidden states of every token ``[T, hidden]`` (rows in ``items`` order)
        and the sampled rows. Decode-only steps go to the decode graphs when there are any."""
        if self.decode_graphs is not None:
            graphed = self.decode_graphs.forward(items, self.model, self.kv_cache)
            if graphed is not None:
                return graphed
        input_ids, positions, meta, sample_rows = self._prepare(items)
        self.batch_context.begin(items, [s.num_tokens + len(s.lookahead_token_ids) for s in items])
        try:
            return self.model(input_ids, positions, self.kv_cache, self.backend, meta), sample_rows
        finally:
            self.batch_context.end()

    def _prompt_logprobs(self, items: list[ScheduledSeq], hidden: torch.Tensor,
                         rows_per_pass: int = 256) -> dict[int, list[SampledToken]]:
        """For chunks that want them: the raw logprob (and top-k) of each prompt token
        the chunk predicts, i.e. prompt[p + 1] from the hidden state at position p."""
        result: dict[int, list[SampledToken]] = {}
        row = 0
        for s in items:
            n = s.num_tokens + len(s.lookahead_token_ids)
            if s.want_prompt_logprobs:
                last = min(s.start_position + s.num_tokens, len(s.prompt_token_ids) - 1)
                count = last - s.start_position
                targets = list(s.prompt_token_ids[s.start_position + 1:last + 1])
                entries: list[SampledToken] = []
                for lo in range(0, count, rows_per_pass):       # bounded [rows, vocab] memory
                    hi = min(count, lo + rows_per_pass)
                    chosen, tops = token_logprobs(self.project(hidden, slice(row + lo, row + hi)),
                                                  torch.tensor(targets[lo:hi], device=self.device),
                                                  s.params.prompt_logprobs)
                    entries.extend(SampledToken(t, v, top) for t, v, top in zip(targets[lo:hi], chosen, tops))
                result[s.seq_id] = entries
            row += n
        return result

    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        """Copy whole KV blocks ``src -> dst`` in every layer (copy-on-write at a fork)."""
        if copies:
            src = torch.tensor([c[0] for c in copies], device=self.device)
            dst = torch.tensor([c[1] for c in copies], device=self.device)
            self.kv_cache[:, :, dst] = self.kv_cache[:, :, src]

    def _prepare(self, items: list[ScheduledSeq]):
        """Flatten the step's sequences into input ids, positions, cache slots and
        attention metadata."""
        bs = self.block_size
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        prefills: list[PrefillChunk] = []
        decode_rows, decode_tables, decode_lens = [], [], []
        sample_rows: list[int] = []
        for s in items:
            row = len(input_ids)
            tokens = s.token_ids + s.lookahead_token_ids if s.lookahead_token_ids else s.token_ids
            start, n = s.start_position, len(tokens)
            input_ids.extend(tokens)
            positions.extend(range(start, start + n))
            table = s.block_table
            slots.extend(table[p // bs] * bs + p % bs for p in range(start, start + n))
            num_blocks = -(-(start + n) // bs)
            if n == 1:
                decode_rows.append(row)
                decode_tables.append(table[:num_blocks])
                decode_lens.append(start + n)
            else:
                mask = None
                if start > 0:
                    query_pos = torch.arange(start, start + n)
                    mask = (torch.arange(start + n)[None, :] <= query_pos[:, None]).to(self.device)
                prefills.append(PrefillChunk(row, n, start, torch.tensor(table[:num_blocks], device=self.device),
                                             mask))
            if s.sample:     # the last real token, then each lookahead token: verification rows
                sample_rows.extend(range(row + n - 1 - len(s.lookahead_token_ids), row + n))
        meta = AttentionMetadata(slot_mapping=torch.tensor(slots, device=self.device), prefills=prefills,
                                 decode_groups=self._decode_groups(decode_rows, decode_tables, decode_lens))
        return (torch.tensor(input_ids, device=self.device), torch.tensor(positions, device=self.device),
                meta, torch.tensor(sample_rows, device=self.device))

    def _decode_groups(self, rows, tables, lens) -> list[DecodeGroup]:
        """Single-token sequences batched by ``kvserve.engine.decode_groups``."""
        return [self._decode_group([rows[i] for i in g], [tables[i] for i in g], [lens[i] for i in g])
                for g in decode_groups(lens, self.block_size)]

    def _decode_group(self, rows, tables, lens) -> DecodeGroup:
        max_blocks = max(len(t) for t in tables)
        flat_ids = [b for t in tables for b in t + [0] * (max_blocks - len(t))]
        lens_t = torch.tensor(lens)
        mask = torch.arange(max_blocks * self.block_size)[None, :] < lens_t[:, None]    # [D, S]
        return DecodeGroup(token_index=torch.tensor(rows, device=self.device),
                           block_ids=torch.tensor(flat_ids, device=self.device), max_blocks=max_blocks,
                           mask=mask[:, None, None, :].to(self.device))


def expert_counters(blocks: list, collective_seconds: list[float], tensor_parallel_size: int = 1,
                    total_collective_seconds: float = 0.0) -> ParallelCounters:
    """``ParallelCounters`` from mixture-of-experts blocks (each with ``expert_load``: rows per
    expert in its last forward, and ``expert_tokens_total``: since start) and the sparse
    layers' per-forward collective seconds."""
    totals = [b.expert_tokens_total for b in blocks if getattr(b, "expert_tokens_total", None) is not None]
    loads = [b.expert_load.float() for b in blocks if b.expert_load is not None]
    imbalance = sum(float(l.max() / l.mean()) for l in loads if float(l.sum()) > 0) / len(loads) if loads else 0.0
    ordered = sorted(collective_seconds)
    def quantile(q: float) -> float:
        return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else 0.0
    return ParallelCounters(tensor_parallel_size=tensor_parallel_size, collective_seconds=total_collective_seconds,
                            expert_tokens=[int(x) for x in sum(totals).tolist()] if totals else [],
                            expert_imbalance=round(imbalance, 4), sparse_collective_p50_s=quantile(0.5),
                            sparse_collective_p99_s=quantile(0.99))
