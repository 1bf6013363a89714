"""The runner of a tensor-parallel replica: rank 0's ``ModelRunner`` that drives the
other ranks. It sends each forward's ``ForwardWork``, each vocabulary projection's hidden
rows to project (the workers project their own copies of the forward's hidden states) and
each KV block copy to the workers before doing the same on its own shard, so the
collectives inside the model pair up. Sampling, grammar masks and verification run
on rank 0 alone, on the gathered logits; the scheduler never knows there are ranks.
"""
from __future__ import annotations

import logging
import subprocess

import torch

from kvserve.engine.model_runner import ModelRunner, expert_counters
from kvserve.engine.stats import ParallelCounters
from kvserve.engine.step import ForwardWork

logger = logging.getLogger("kvserve.parallel")


class _ProjectsOnRanks:
    """Vocabulary projections of a runner that drives ranks (``self.group``): ``project`` names
    the rows (a list of indices or a slice, a few bytes where the rows are ``rows x hidden``
    floats) and each worker projects its own copy of the last forward's hidden states;
    ``logits`` (hidden rows a caller built itself) sends the rows. Either way the logits'
    all-gather pairs with the workers'."""

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        self.group.broadcast_object(("logits", hidden))
        return ModelRunner.logits(self, hidden)

    def project(self, hidden: torch.Tensor, rows) -> torch.Tensor:
        self.group.broadcast_object(("project", rows.tolist() if isinstance(rows, torch.Tensor) else rows))
        return ModelRunner.logits(self, hidden[rows])


class TensorParallelRunner(_ProjectsOnRanks, ModelRunner):
    """``ModelRunner`` on rank 0's shard (``model`` is a ``TensorParallelModel``) that
    also drives ranks 1..N-1 (``workers``, their processes) through ``group``."""

    def __init__(self, *args, group, workers, **kwargs):
        super().__init__(*args, **kwargs)
        self.group, self.workers = group, workers
        self._closed = False

    def _forward(self, items):
        self.group.broadcast_object(("forward", [ForwardWork.of(s) for s in items]))
        return super()._forward(items)

    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        if copies:
            self.group.broadcast_object(("copy", copies))
        super().copy_blocks(copies)

    def parallel_counters(self) -> ParallelCounters:
        """The replica's ranks, rank 0's collective seconds, and (MoE) expert load and the
        sparse layers' collective seconds per forward."""
        blocks = list(self.model.expert_parallel_blocks().values())
        return expert_counters(blocks, [s for b in blocks for s in b.comm_seconds], self.group.world_size,
                               self.group.comm_seconds)

    @property
    def comm_seconds(self) -> float:
        """Rank 0's wall time inside collectives (all-reduce, all-gather) so far."""
        return self.group.comm_seconds

    def close(self, timeout_s: float = 10.0) -> None:
        """Stop the workers (``stop``, then join; terminate one that does not leave)."""
        if self._closed:
            return
        self._closed = True
        try:
            self.group.broadcast_object(("stop", None))
        except RuntimeError as exc:          # a worker already gone
            logger.warning("tensor-parallel stop: %s", exc)
        for proc in self.workers:
            try:
                proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                proc.terminate()
                proc.wait(timeout_s)


class TensorParallelDraftRunner(_ProjectsOnRanks, ModelRunner):
    """Rank 0's runner of a self-draft under tensor parallelism: forwards of the shard's
    first ``num_layers`` layers (``model`` is the truncated view), each announced to the
    other ranks as ``draft_forward`` so they run the same layers of their shards; vocabulary
    projections as the target's (``logits``). The draft reads the target's KV: no copies."""

    def __init__(self, *args, group, num_layers: int, **kwargs):
        super().__init__(*args, **kwargs)
        self.group, self.num_layers = group, num_layers

    def _forward(self, items):
        self.group.broadcast_object(("draft_forward", (self.num_layers, [ForwardWork.of(s) for s in items])))
        return super()._forward(items)
