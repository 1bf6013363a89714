"""Decode steps replayed as CUDA graphs (the runner's fast path on a GPU).

A decode step of a small model does little arithmetic per kernel and launches some forty
kernels per layer from Python: on a GPU the step is bound by the host's launch loop, not
the device (``benchmarks/gpu_throughput.json``: eager, one sequence decoded at 34.5 tokens/s
on an H200, 0.2% of the weight-read bound; with graphs 288). A CUDA graph records the kernels
of one forward once and replays them with one launch; the host only fills the graph's input
buffers.

A graph's shapes are fixed, so a decode-only step (every sequence computes one token, none
carries lookahead tokens) is padded into a bucket: the batch rounded up to
:func:`batch_bucket`, each sequence's block table to :func:`context_bucket` blocks (a power
of two). Padding rows repeat the first sequence (its token, position, cache slot and block
table): they write the same K/V into the same slot, so padding leaves the cache as the real
rows leave it, and their hidden states are dropped. Padded table entries point at block 0
and are masked. Each bucket is captured the first time a step needs it, after one eager run
of the same forward (which also lets the kernels initialise); all graphs share one memory
pool, and each has its own attention backend, so their gather workspaces never move.

Steps that mix prefill chunks, carry lookahead tokens, or outgrow the largest bucket run
eagerly. A graph holds the addresses of the weights and the KV cache it was captured on: when
the runner's model or KV tensor is another object than the graphs were built for (weights
loaded in place, a sleep and wake: ``engine/weight_swap.py``), every graph is dropped and the
buckets are captured again. ``capture=False`` runs the padded forward eagerly on the same buffers: the path's
padding and bucketing checked on a CPU, where no graph exists.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from kvserve.attention import AttentionMetadata, DecodeGroup

logger = logging.getLogger(__name__)

MIN_CONTEXT_BLOCKS = 4     # the smallest context bucket, in KV blocks


def batch_bucket(num_seqs: int, max_num_seqs: int) -> int:
    """The batch size a step of ``num_seqs`` decodes is padded to: 1, 2, 4, 8, then
    multiples of 8 up to 64, then of 32, never past ``max_num_seqs``."""
    if num_seqs <= 8:
        bucket = 1 << (num_seqs - 1).bit_length()
    else:
        step = 8 if num_seqs <= 64 else 32
        bucket = -(-num_seqs // step) * step
    return min(bucket, max_num_seqs)


def context_bucket(num_blocks: int, max_blocks: int) -> int:
    """The block-table width a step whose longest sequence holds ``num_blocks`` blocks is
    padded to: the next power of two, at least ``MIN_CONTEXT_BLOCKS``, at most ``max_blocks``."""
    return min(max(MIN_CONTEXT_BLOCKS, 1 << (num_blocks - 1).bit_length()), max_blocks)


@dataclass
class GraphEntry:
    """One bucket's static buffers, its output and (on CUDA) its captured graph."""

    input_ids: torch.Tensor      # [B] int64
    positions: torch.Tensor      # [B] int64
    slots: torch.Tensor          # [B] int64 cache slot written by each row
    lens: torch.Tensor           # [B] int64 positions each row attends
    block_ids: torch.Tensor      # [B * S] int64 block tables, row-major
    forward: Callable[[], torch.Tensor]
    hidden: torch.Tensor | None = None   # [B, hidden] the forward's output (static under a graph)
    graph: "torch.cuda.CUDAGraph | None" = None


class DecodeGraphs:
    """Padded, bucketed, graph-replayed forwards of decode-only steps for one model.

    ``make_backend()`` builds a fresh attention backend (one per bucket); ``max_blocks`` is
    the widest block table a sequence can have (the context length in blocks)."""

    def __init__(self, model, kv_cache, make_backend: Callable[[], object], block_size: int,
                 max_num_seqs: int, max_blocks: int, device: torch.device, capture: bool = True):
        self.model = model
        self.kv_cache = kv_cache
        self.make_backend = make_backend
        self.block_size = block_size
        self.max_num_seqs = max_num_seqs
        self.max_blocks = max_blocks
        self.device = device
        self.capture = capture and device.type == "cuda"
        self.entries: dict[tuple[int, int], GraphEntry] = {}
        self.pool = None                  # the graphs' shared memory pool (first capture)
        self.capture_seconds = 0.0        # spent capturing, all buckets
        self.replays = 0                  # steps served by this path

    def forward(self, items: Sequence, model, kv_cache) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Final hidden states ``[len(items), hidden]`` and the sampled rows of a decode-only
        step of ``model`` on ``kv_cache`` (the runner's now), or None when the step does not fit
        this path. The hidden states are a view of the bucket's static output: valid until the
        next forward."""
        if model is not self.model or kv_cache is not self.kv_cache:
            self.reset(model, kv_cache)
        if not items or len(items) > self.max_num_seqs:
            return None
        if any(s.num_tokens != 1 or s.lookahead_token_ids for s in items):
            return None
        needed = max(s.start_position // self.block_size + 1 for s in items)
        if needed > self.max_blocks:
            return None
        key = (batch_bucket(len(items), self.max_num_seqs), context_bucket(needed, self.max_blocks))
        entry = self.entries.get(key)
        fresh = entry is None
        if fresh:
            entry = self._new_entry(*key)
        self._fill(entry, items, key[1])
        if fresh:
            self._capture(entry, key)
        elif entry.graph is not None:
            entry.graph.replay()
        else:
            entry.hidden = entry.forward()
        self.replays += 1
        sample_rows = [i for i, s in enumerate(items) if s.sample]
        return entry.hidden[:len(items)], torch.tensor(sample_rows, dtype=torch.int64, device=self.device)

    def reset(self, model, kv_cache) -> None:
        """Drop every graph (they hold the old weights' and KV tensor's addresses) and bind to
        ``model`` and ``kv_cache``; buckets are captured again as steps need them."""
        logger.info("decode graphs: the model or KV cache changed, %d graphs dropped", len(self.entries))
        self.model, self.kv_cache = model, kv_cache
        self.entries.clear()
        self.pool = None
        if self.capture:
            torch.cuda.empty_cache()

    def _new_entry(self, batch: int, width: int) -> GraphEntry:
        """Static buffers for ``batch`` rows of ``width`` blocks, and the forward over them."""
        def zeros(n: int) -> torch.Tensor:
            return torch.zeros(n, dtype=torch.int64, device=self.device)
        entry = GraphEntry(zeros(batch), zeros(batch), zeros(batch), zeros(batch), zeros(batch * width),
                           forward=lambda: None)
        backend = self.make_backend()
        token_index = torch.arange(batch, device=self.device)
        key_positions = torch.arange(width * self.block_size, device=self.device)

        def forward() -> torch.Tensor:
            mask = (key_positions[None, :] < entry.lens[:, None])[:, None, None, :]
            meta = AttentionMetadata(slot_mapping=entry.slots, decode_groups=[
                DecodeGroup(token_index=token_index, block_ids=entry.block_ids, max_blocks=width, mask=mask)])
            return self.model(entry.input_ids, entry.positions, self.kv_cache, backend, meta)
        entry.forward = forward
        return entry

    def _fill(self, entry: GraphEntry, items: Sequence, width: int) -> None:
        """Copy the step's ids, positions, slots, lengths and tables into the buffers (one
        host-to-device copy), padding rows with the first sequence."""
        bs, batch = self.block_size, entry.input_ids.numel()
        rows = list(items) + [items[0]] * (batch - len(items))
        ids, positions, slots, lens, tables = [], [], [], [], []
        for s in rows:
            p = s.start_position
            ids.append(s.token_ids[0])
            positions.append(p)
            slots.append(s.block_table[p // bs] * bs + p % bs)
            lens.append(p + 1)
            table = s.block_table[:p // bs + 1]
            tables.extend(table + [0] * (width - len(table)))
        host = torch.tensor(ids + positions + slots + lens + tables, dtype=torch.int64)
        packed = host.to(self.device)
        for i, buf in enumerate((entry.input_ids, entry.positions, entry.slots, entry.lens)):
            buf.copy_(packed[i * batch:(i + 1) * batch])
        entry.block_ids.copy_(packed[4 * batch:])

    def _capture(self, entry: GraphEntry, key: tuple[int, int]) -> None:
        """First use of a bucket: one eager forward (its output serves this step), then,
        on CUDA, the graph of the same forward. A forward that cannot be captured (a model
        that reads values back to the host) turns this path off for good."""
        started = time.perf_counter()
        if not self.capture:
            entry.hidden = entry.forward()
            self.entries[key] = entry
            return
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            entry.hidden = entry.forward()
        torch.cuda.current_stream(self.device).wait_stream(stream)
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(graph, pool=self.pool):
                captured = entry.forward()
        except RuntimeError as exc:
            logger.warning("decode graphs off: capture failed (%s)", exc)
            self.max_num_seqs = 0
            return
        entry.graph, entry.hidden = graph, captured
        graph.replay()                  # fills the captured output (same K/V written again)
        self.entries[key] = entry
        elapsed = time.perf_counter() - started
        self.capture_seconds += elapsed
        logger.info("captured decode graph: %d rows x %d blocks in %.3f s", key[0], key[1], elapsed)
