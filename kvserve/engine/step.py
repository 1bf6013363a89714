"""Plain data at the edges of one engine step: StepPlan in, StepResult out
(docs/architecture.md, "The step contract").

Ints, lists and the request's SamplingParams only: no tensors cross this boundary.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from kvserve.engine.structured_spec import StructuredSpec
from kvserve.sampling.params import SamplingParams


@dataclass
class ScheduledSeq:
    """One sequence's work this step: compute ``token_ids`` at positions
    ``[start_position, start_position + len(token_ids))``, writing their KV into
    ``block_table``; if ``sample``, also sample the token that follows."""

    seq_id: int
    token_ids: list[int]
    start_position: int
    block_table: list[int]
    sample: bool
    params: SamplingParams
    prompt_token_ids: list[int]
    output_token_ids: list[int]      # read-only view for penalties / min_tokens / seeds
    eos_token_ids: frozenset[int]
    sibling_index: int
    adapter_key: str | None = None   # the loaded adapter's identity (None = base weights)
    # Lookahead (speculative) tokens: ``lookahead_limit`` is the most this sequence may
    # take this step (its max_tokens, the context and the request's cap); a speculator
    # reserves ``num_lookahead_slots`` of them (blocks and budget) and fills
    # ``lookahead_token_ids`` (possibly fewer) before the runner verifies them.
    lookahead_limit: int = 0
    num_lookahead_slots: int = 0
    lookahead_token_ids: list[int] = field(default_factory=list)
    # prompt_logprobs: also return the logprob of each prompt token this chunk predicts
    # (the token after each position, while it is still a prompt token).
    want_prompt_logprobs: bool = False
    # Structured output: the runner masks this sequence's sampling rows to the spec's grammar.
    structured: StructuredSpec | None = None

    @property
    def num_tokens(self) -> int:
        """Tokens that are certainly computed (lookahead tokens are counted separately)."""
        return len(self.token_ids)

    @property
    def context_len(self) -> int:
        """Tokens in the KV cache once this step's tokens are written."""
        return self.start_position + len(self.token_ids)


@dataclass
class ForwardWork:
    """The part of a ``ScheduledSeq`` a forward pass needs to build its inputs (token ids,
    positions, KV slots, sampled rows): what a tensor-parallel rank receives, and what a
    warm-up pass is made of. No sampling state."""

    token_ids: list[int]
    start_position: int
    block_table: list[int]
    sample: bool
    lookahead_token_ids: list[int] = field(default_factory=list)
    adapter_key: str | None = None   # base weights (tensor-parallel ranks and warm-up run no LoRA)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @classmethod
    def of(cls, seq: ScheduledSeq) -> "ForwardWork":
        """The forward-only view of a scheduled sequence."""
        return cls(seq.token_ids, seq.start_position, seq.block_table, seq.sample, seq.lookahead_token_ids,
                   seq.adapter_key)


@dataclass
class StepPlan:
    """What the runner executes this step."""

    scheduled: list[ScheduledSeq] = field(default_factory=list)
    # (src_block, dst_block) KV copies to perform before the forward pass
    # (copy-on-write of a partially filled block shared at an n > 1 fork).
    block_copies: list[tuple[int, int]] = field(default_factory=list)
    preempted_seq_ids: list[int] = field(default_factory=list)
    token_budget_left: int = 0       # of max_num_batched_tokens, for lookahead tokens

    @property
    def num_tokens(self) -> int:
        """Tokens the forward pass computes, lookahead tokens included."""
        return sum(s.num_tokens + len(s.lookahead_token_ids) for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


@dataclass
class SampledToken:
    """The token sampled for one sequence, with logprobs when asked."""

    token_id: int
    logprob: float | None = None
    top_logprobs: list[tuple[int, float]] = field(default_factory=list)


@dataclass
class StepResult:
    """Runner output: one SampledToken per ScheduledSeq with ``sample`` set.

    A sequence that verified lookahead tokens emits ``accepted_lookahead[seq_id]`` (the
    ones the target accepted, in order) and then ``sampled[seq_id]``.
    """

    sampled: dict[int, SampledToken] = field(default_factory=dict)   # seq_id -> token
    accepted_lookahead: dict[int, list[SampledToken]] = field(default_factory=dict)
    # seq_id -> logprobs of prompt tokens start_position + 1 .. (in order), when asked
    prompt_logprobs: dict[int, list[SampledToken]] = field(default_factory=dict)
    forward_time_s: float = 0.0


@dataclass
class SeqUpdate:
    """What one sequence produced in a step (or its end), for the output processor."""

    seq_id: int
    request_id: str
    sibling_index: int
    new_token_ids: list[int]
    new_logprobs: list[SampledToken]
    finish_reason: str | None = None
    num_cached_tokens: int = 0       # prompt tokens of this request served by the prefix cache
    num_draft_proposed: int = 0      # lookahead (draft) tokens verified this step
    num_draft_accepted: int = 0      # of those, accepted (they lead new_token_ids)
    prompt_logprobs: list[SampledToken] = field(default_factory=list)   # next prompt tokens' logprobs
