"""Request outputs in the shape vLLM users know: RequestOutput with CompletionOutputs."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class CompletionOutput:
    """One generated sequence of a request (``n`` of them per request)."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None            # "stop", "length", "abort"
    stop_reason: str | int | None = None        # the stop string or stop token id that matched
    logprobs: list[dict[int, float]] | None = None   # per token: {chosen id: lp, top-k ids: lp}
    cumulative_logprob: float | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    """A request's prompt and its outputs; ``finished`` once every output has ended."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)
    num_cached_tokens: int = 0
    # prompt_logprobs: one {prompt token id: lp, top-k ids: lp} per prompt token; None first
    prompt_logprobs: list[dict[int, float] | None] | None = None
    num_draft_tokens: int = 0                  # speculative drafts verified for this request
    num_accepted_draft_tokens: int = 0         # of those, accepted

    @property
    def draft_acceptance_rate(self) -> float | None:
        """Accepted / verified drafts; None when the request never speculated."""
        return self.num_accepted_draft_tokens / self.num_draft_tokens if self.num_draft_tokens else None

    @property
    def finished(self) -> bool:
        return all(o.finished for o in self.outputs)
