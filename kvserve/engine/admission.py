"""The admission rule, in one place: can this prompt and ``max_tokens`` run on this
engine at all? Pure Python, used by the engine (``EngineCore.validate_request``) and by
the HTTP process before it sends any header (a refusal is a typed error, never a clamp).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from kvserve.errors import ContextLengthExceededError, InvalidRequestError


@dataclass(frozen=True)
class EngineLimits:
    """The numbers a request is checked against (the HTTP process gets them from
    ``EngineReady``)."""

    max_model_len: int
    vocab_size: int
    block_size: int
    num_blocks: int
    kv_max_tokens: int


def check_grace_s(value: float | None, param: str = "prefix_cache_grace_s") -> None:
    """A cache grace time must be a finite number >= 0 (None: not set)."""
    if value is not None and not 0 <= value < math.inf:
        raise InvalidRequestError(f"{param} must be a finite number >= 0", param=param)


def check_token_ids(prompt: list[int], vocab_size: int) -> None:
    """Prompt token ids must be ints inside the vocabulary."""
    bad = next((t for t in prompt if not isinstance(t, int) or t < 0 or t >= vocab_size), None)
    if bad is not None:
        raise InvalidRequestError(f"token id {bad!r} is outside the vocabulary [0, {vocab_size})", param="prompt")


def check_logit_bias(logit_bias: dict[int, float] | None, vocab_size: int) -> None:
    """Every ``logit_bias`` key must be a token id of the vocabulary."""
    if logit_bias and max(logit_bias) >= vocab_size:
        raise InvalidRequestError(f"logit_bias token id {max(logit_bias)} is outside the vocabulary "
                                  f"[0, {vocab_size})", param="logit_bias")


def check_context(num_prompt_tokens: int, max_tokens: int | None, limits: EngineLimits,
                  prompt_param: str = "prompt", max_tokens_param: str = "max_tokens") -> None:
    """Raise a typed error unless a prompt of ``num_prompt_tokens`` plus ``max_tokens``
    (None: up to the context) fits the context and the KV cache."""
    num, limit = num_prompt_tokens, limits.max_model_len
    if num == 0:
        raise InvalidRequestError("the prompt is empty", param=prompt_param)
    if num >= limit:
        raise ContextLengthExceededError(
            f"the prompt has {num} tokens; this model's context is {limit} tokens and at least one "
            f"must be left to generate", param=prompt_param)
    if max_tokens is not None and num + max_tokens > limit:
        raise ContextLengthExceededError(
            f"prompt ({num} tokens) + {max_tokens_param} ({max_tokens}) = {num + max_tokens} exceeds "
            f"the context of {limit} tokens", param=max_tokens_param)
    bs = limits.block_size
    needed = min(math.ceil(limit / bs), math.ceil((num + (max_tokens or 0)) / bs))
    if needed > limits.num_blocks:
        prompt_fits = math.ceil(num / bs) <= limits.num_blocks
        raise ContextLengthExceededError(
            f"the KV cache ({limits.kv_max_tokens} tokens) cannot hold this request: prompt ({num} tokens) + "
            f"{max_tokens_param} ({max_tokens or 0})",
            param=max_tokens_param if prompt_fits and max_tokens else prompt_param)
