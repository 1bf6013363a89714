"""Replay kvserve's token-budget scheduler on paper, to predict an offline run's wall time.

Mirrors ``kvserve.engine.scheduler`` (without importing it): each step hands out
``max_num_batched_tokens`` to running sequences first (oldest first), then admits
waiting ones in arrival order while fewer than ``max_num_seqs`` run. A sequence
whose computed tokens reach its known tokens samples one token that step. No
preemption is modelled (the caller checks the KV pool is large enough).

Each step becomes a :class:`StepWork`; ``predict_seconds`` sums the roofline times.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Sequence

from kvserve.engine.decode_groups import decode_groups
from kvserve.planner.roofline import CostModel, StepWork, chunk_attention, step_time


@dataclass(frozen=True)
class SchedulerLimits:
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 1024
    block_size: int = 16


@dataclass
class _Seq:
    prompt: int
    max_output: int
    computed: int = 0
    outputs: int = 0

    @property
    def known(self) -> int:
        return self.prompt + self.outputs


@dataclass(frozen=True)
class StepShape:
    """One step: (start, n) per scheduled sequence, and how many sequences sample."""

    chunks: tuple[tuple[int, int], ...]
    num_sampled: int


def schedule_offline(requests: Sequence[tuple[int, int]], limits: SchedulerLimits) -> list[StepShape]:
    """Steps the engine takes for ``requests`` = [(prompt tokens, output tokens)], all queued at once."""
    waiting = [_Seq(p, o) for p, o in requests]
    waiting.reverse()                        # pop() takes the oldest
    running: list[_Seq] = []
    steps: list[StepShape] = []
    while running or waiting:
        budget = limits.max_num_batched_tokens
        planned: list[tuple[_Seq, int]] = []
        for seq in running:
            if budget <= 0:
                break
            n = min(seq.known - seq.computed, budget)
            if n > 0:
                planned.append((seq, n))
                budget -= n
        while waiting and budget > 0 and len(running) < limits.max_num_seqs:
            seq = waiting.pop()
            running.append(seq)
            n = min(seq.known - seq.computed, budget)
            planned.append((seq, n))
            budget -= n
        chunks, sampled = [], 0
        for seq, n in planned:
            chunks.append((seq.computed, n))
            seq.computed += n
            if seq.computed == seq.known:
                seq.outputs += 1
                sampled += 1
        running = [s for s in running if s.outputs < s.max_output]
        steps.append(StepShape(tuple(chunks), sampled))
    return steps


def step_work(shape: StepShape, mode: str, block_size: int = 16) -> StepWork:
    """The StepWork of one step: decode kernels over single-token rows, one per multi-token chunk.

    ``mode`` "padded" (torch reference backend): decodes run in length groups, each reading its
    sequences' KV padded to the group's longest (in blocks); "sum": each sequence reads its own KV.
    """
    decode_ctx = [start + n for start, n in shape.chunks if n == 1]
    attn = []
    if decode_ctx and mode == "padded":
        for indices in decode_groups(decode_ctx, block_size):
            group = [decode_ctx[i] for i in indices]
            kv = len(group) * -(-max(group) // block_size) * block_size
            attn.append((float(kv), float(kv)))
    elif decode_ctx:
        attn.append((float(sum(decode_ctx)), float(sum(decode_ctx))))
    attn += [chunk_attention(start, n, mode) for start, n in shape.chunks if n > 1]
    return StepWork(sum(n for _, n in shape.chunks), shape.num_sampled, tuple(attn))


def predict_seconds(cm: CostModel, steps: Iterable[StepShape], block_size: int = 16) -> float:
    """Sum of the roofline step times."""
    mode = cm.hw.kv_read_mode
    return sum(step_time(cm, step_work(s, mode, block_size)).total_s for s in steps)


def predict_run(cm: CostModel, requests: Sequence[tuple[int, int]], limits: SchedulerLimits) -> dict:
    """Predicted wall time and output tokens/s of an offline run of ``requests``."""
    steps = schedule_offline(requests, limits)
    seconds = predict_seconds(cm, steps, limits.block_size) + cm.hw.request_overhead_s * len(requests)
    outputs = sum(o for _, o in requests)
    return {"seconds": seconds, "steps": len(steps), "output_tokens": outputs,
            "output_tokens_per_s": outputs / seconds if seconds > 0 else float("inf")}
