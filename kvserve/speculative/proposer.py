"""What every proposer is, and the registry that builds one by name.

A proposer fills lookahead slots the speculator reserved: ``propose(plan)`` returns a
``Draft`` per sequence with ``num_lookahead_slots > 0`` (at most that many tokens, maybe
none). ``kvserve.speculative.registry`` maps each ``SpeculativeConfig.method`` name to
its ``ProposerEntry``; a new proposer is one module and one line there.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Protocol

from kvserve.engine.step import StepPlan


@dataclass(frozen=True)
class Draft:
    """Lookahead tokens for one sequence; ``probs`` ``[len(token_ids), vocab]`` holds the
    distributions they were sampled from (None: point masses, e.g. n-gram or greedy)."""

    token_ids: list[int]
    probs: object = None          # torch.Tensor | None


class Proposer(Protocol):
    uses_model: bool                          # draft passes cost time (the controller models them)
    pass_times: list[tuple[int, float]]       # (sequences, seconds) of this step's draft passes

    def propose(self, plan: StepPlan) -> dict[int, Draft]:
        """Drafts for the plan's sequences with lookahead slots."""

    def on_step_done(self, plan: StepPlan, accepted_counts: dict[int, int], finished_seq_ids) -> None:
        """Verification is known: ``accepted_counts[seq_id]`` drafts were accepted."""

    def forget(self, seq_ids) -> None:
        """Drop state of sequences that ended or restart from scratch."""

    def tracked_seq_ids(self) -> set[int]:
        """Sequences the proposer keeps state for."""


@dataclass(frozen=True)
class ProposerContext:
    """What a proposer may be built from: the speculation settings, the target model and
    its KV layout, and (for ``draft_model_path`` entries) the loaded draft model."""

    spec: object                  # SpeculativeConfig
    target_model: object
    target_config: object         # ModelConfig
    kv_cache: object              # the target's KV tensor [layers, 2, blocks, block_size, KVH, D]
    num_blocks: int
    block_size: int
    attention_backend: str
    device: object
    dtype: object
    seed: int
    draft_model: object = None
    # tensor parallelism: layers -> a runner factory (ModelRunner's arguments) whose forwards of
    # the target's first ``layers`` also run on the other ranks; None with one rank
    sharded_runner: Callable | None = None


@dataclass(frozen=True)
class ProposerEntry:
    """A registered proposer: how to build it, and which second model (if any) must be
    loaded before the KV cache is sized (its KV shares the block ids and the budget)."""

    build: Callable[[ProposerContext], Proposer]
    draft_model_path: Callable[[object], str | None] = lambda spec: None
