"""Run kvserve's own scheduler without a model, to predict an offline run's wall time.

``schedule_offline`` drives the engine's real :class:`~kvserve.engine.scheduler.Scheduler`
over a :class:`~kvserve.engine.kv.manager.KVCacheManager` and :class:`BlockPool` (no prefix
cache), queuing every request at once and answering each step with a synthetic
``StepResult`` (one placeholder token per sampling sequence; ``ignore_eos`` so every request
produces exactly its output tokens). The steps are therefore the engine's by construction:
token budget, ``max_num_seqs``, chunked prefill, (priority, arrival) order, when a sequence
samples and when it leaves the running set. By default the block pool holds every request's
prompt and output at once, so nothing is preempted; ``SchedulerLimits.num_blocks`` sets a
smaller pool, and then the steps include the engine's recompute preemptions.

Each step becomes a :class:`StepShape`, then a :class:`StepWork`; ``predict_seconds`` sums
the roofline times. Pure Python: the engine's scheduler and KV modules never import torch.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Iterator, Sequence

from kvserve.engine.decode_groups import decode_groups
from kvserve.engine.kv.block_pool import BlockPool
from kvserve.engine.kv.manager import KVCacheManager
from kvserve.engine.request import EngineRequest
from kvserve.engine.scheduler import Scheduler, SchedulerConfig
from kvserve.engine.step import SampledToken, StepPlan, StepResult
from kvserve.planner.roofline import CostModel, StepWork, chunk_attention, step_time
from kvserve.sampling.params import SamplingParams

_TOKEN = 1                    # every prompt and sampled token id (no cache, no EOS: any id works)


@dataclass(frozen=True)
class SchedulerLimits:
    """The engine settings that shape its steps.

    ``num_blocks``: KV blocks in the simulated pool; None (default) = enough for every
    request's prompt and output at once, so nothing is preempted. A smaller pool makes the
    scheduler preempt (by recompute) exactly as the engine would with that many blocks and
    its prefix cache off.
    """

    max_num_seqs: int = 64
    max_num_batched_tokens: int = 1024
    block_size: int = 16
    num_blocks: int | None = None


@dataclass(frozen=True)
class StepShape:
    """One step: (start, n) per scheduled sequence, and how many sequences sample."""

    chunks: tuple[tuple[int, int], ...]
    num_sampled: int


def _scheduler(requests: Sequence[tuple[int, int]], limits: SchedulerLimits) -> Scheduler:
    """A real scheduler over its own block pool, with ``requests`` queued in order."""
    for prompt, output in requests:
        if prompt < 1 or output < 1:
            raise ValueError(f"requests need >= 1 prompt and output token, got ({prompt}, {output})")
    num_blocks = limits.num_blocks
    if num_blocks is None:
        num_blocks = max(1, sum(-(-(p + o) // limits.block_size) for p, o in requests))
    kv = KVCacheManager(BlockPool(num_blocks, limits.block_size), prefix_cache=None)
    sched = Scheduler(SchedulerConfig(limits.max_num_seqs, limits.max_num_batched_tokens), kv,
                      max_model_len=None)
    for i, (prompt, output) in enumerate(requests):
        params = SamplingParams(max_tokens=output, temperature=0, ignore_eos=True)
        sched.add_request(EngineRequest(request_id=str(i), prompt_token_ids=[_TOKEN] * prompt, params=params))
    return sched


def scheduled_steps(requests: Sequence[tuple[int, int]], limits: SchedulerLimits) -> Iterator[StepPlan]:
    """The engine scheduler's ``StepPlan`` for each step of ``requests`` (request ``i`` is
    sequence ``i``), each answered with a synthetic ``StepResult`` once the caller moves on.

    Raises ValueError if a step schedules nothing (a pool too small for one sequence).
    """
    sched = _scheduler(requests, limits)
    while sched.has_unfinished():
        plan = sched.schedule()
        if plan.is_empty:
            raise ValueError(f"the scheduler cannot make progress with {sched.kv.num_blocks} KV blocks")
        yield plan
        sched.update(plan, StepResult(sampled={s.seq_id: SampledToken(_TOKEN)
                                               for s in plan.scheduled if s.sample}))


def schedule_offline(requests: Sequence[tuple[int, int]], limits: SchedulerLimits) -> list[StepShape]:
    """Steps the engine takes for ``requests`` = [(prompt tokens, output tokens)], all queued at once."""
    return [StepShape(tuple((s.start_position, s.num_tokens) for s in plan.scheduled),
                      sum(s.sample for s in plan.scheduled))
            for plan in scheduled_steps(requests, limits)]


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
