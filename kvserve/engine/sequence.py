"""A sequence: one stream of tokens the scheduler computes (a request with n > 1 has n)."""
from __future__ import annotations

import enum
from dataclasses import dataclass, field

from kvserve.engine.kv.prefix_cache import PrefixHandle
from kvserve.engine.kv.cache_events import CacheNamespace
from kvserve.engine.service_class import ServiceClass
from kvserve.engine.structured_spec import StructuredSpec
from kvserve.sampling.params import SamplingParams


def token_slice(prompt: list[int], output: list[int], start: int, end: int) -> list[int]:
    """Token ids at positions ``[start, end)`` of ``prompt + output`` (without building it)."""
    num_prompt = len(prompt)
    if end <= num_prompt:
        return prompt[start:end]
    if start >= num_prompt:
        return output[start - num_prompt:end - num_prompt]
    return prompt[start:] + output[:end - num_prompt]


class SeqStatus(enum.Enum):
    WAITING = "waiting"     # not holding blocks (new, or preempted for recompute)
    RUNNING = "running"     # holding blocks, scheduled every step it fits the budget
    FINISHED = "finished"


class FinishReason(str, enum.Enum):
    STOP = "stop"           # EOS, a stop token id, or a stop string (seen by the front end)
    LENGTH = "length"       # max_tokens or the context limit
    ABORT = "abort"         # client gone, deadline, drain, or an explicit abort


@dataclass(eq=False)
class Sequence:
    """Scheduler-side state of one token stream.

    ``num_computed_tokens`` counts tokens whose KV is in ``block_table``; the tokens
    still to compute are ``all_token_ids[num_computed_tokens:]``.
    """

    seq_id: int
    request_id: str
    sibling_index: int
    prompt_token_ids: list[int]
    params: SamplingParams
    max_tokens: int                       # resolved: never None here
    eos_token_ids: frozenset[int]
    priority: int = 0                     # lower value runs first
    arrival_index: int = 0                # FCFS order within a priority value
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    block_table: list[int] = field(default_factory=list)
    status: SeqStatus = SeqStatus.WAITING
    finish_reason: FinishReason | None = None
    num_preemptions: int = 0
    # n > 1: siblings still to be forked from this (leader) sequence once its
    # prompt, but for the last token, is computed. Empty for everyone else.
    pending_fork: list["Sequence"] = field(default_factory=list)
    # Prefix cache: the namespace this sequence reads and writes (None = opted out or
    # the cache is off); while RUNNING, the locked handle of its longest cached prefix.
    cache_namespace: CacheNamespace | None = None
    cache_handle: PrefixHandle | None = None
    num_cached_tokens: int = 0            # prompt tokens served by the cache at first admission
    cache_grace_s: float | None = None    # protection after finishing; None = the scheduler's default
    # Lookahead (speculative) tokens per step for this sequence: None = the engine's
    # setting, 0 = never (the request's num_speculative_tokens).
    max_lookahead_tokens: int | None = None
    # The loaded adapter's identity (None = base weights): cache namespace and residency.
    adapter_key: str | None = None
    # prompt_logprobs: prompt positions whose logprob was already reported (a recompute
    # after preemption does not report them twice). Position 0 has none.
    num_prompt_logprobs_done: int = 1
    # Scheduling policy inputs: the request's latency class, its tenant (None: none named;
    # the fair-share policy's accounting), when it was added (the scheduler's clock), and
    # how many schedule() calls in a row passed it over.
    service_class: ServiceClass = ServiceClass.CHAT
    tenant: str | None = None
    arrival_time: float = 0.0
    num_steps_passed_over: int = 0
    # Structured output: the constraint its output must match (None = unconstrained).
    structured: StructuredSpec | None = None

    @property
    def num_tokens(self) -> int:
        """Prompt plus output tokens."""
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    def token_slice(self, start: int, end: int) -> list[int]:
        """Token ids at positions ``[start, end)`` of prompt + output."""
        return token_slice(self.prompt_token_ids, self.output_token_ids, start, end)

    @property
    def num_tokens_to_compute(self) -> int:
        """Tokens not yet in the KV cache; a leader stops one short of its prompt until it forks."""
        return self.num_tokens_to_compute_after(self.num_computed_tokens)

    def num_tokens_to_compute_after(self, num_computed: int) -> int:
        """``num_tokens_to_compute`` if ``num_computed`` tokens were in the KV cache."""
        if self.pending_fork:
            return max(0, len(self.prompt_token_ids) - 1 - num_computed)
        return self.num_tokens - num_computed

    @property
    def sort_key(self) -> tuple[int, int, int]:
        """Scheduling order: priority value, then arrival, then sibling."""
        return (self.priority, self.arrival_index, self.sibling_index)

    @property
    def is_finished(self) -> bool:
        return self.status is SeqStatus.FINISHED
