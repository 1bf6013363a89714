"""Which engine prefills a request: the threshold rule (llm-d's), a pure function.

A request whose prompt the decode engine would have to compute for fewer than
``threshold_tokens`` tokens (after its own prefix-cache hits) stays unified: the decode
engine prefills it in its own steps. A longer one is prefilled on the prefill engine and
only its missing full blocks move. docs/disaggregation.md has the arithmetic behind a
threshold: the stall a prefill of N tokens puts on every running stream (b x N seconds,
the step-time model's slope) against the cost of moving N tokens' KV.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass

from kvserve.engine.request import EngineRequest


class Route(str, enum.Enum):
    UNIFIED = "unified"               # the decode engine computes the whole prompt
    DISAGGREGATED = "disaggregated"   # the prefill engine computes it, the blocks move


@dataclass(frozen=True)
class RouteDecision:
    """The route and, when disaggregated, the full blocks to move: ``[first_block, end_block)``
    (``first_block`` = blocks the decode engine already caches: they are not moved)."""

    route: Route
    num_uncached_tokens: int
    first_block: int = 0
    end_block: int = 0

    @property
    def num_blocks(self) -> int:
        return self.end_block - self.first_block


def can_disaggregate(request: EngineRequest) -> bool:
    """Whether the prefix cache can carry this request's prompt KV: it reads the cache
    (no opt-out, no prompt logprobs, which need every position computed)."""
    return request.use_prefix_cache and request.params.prompt_logprobs is None


def choose_route(request: EngineRequest, num_decode_cached_blocks: int, block_size: int,
                 threshold_tokens: int) -> RouteDecision:
    """UNIFIED when the tokens the decode engine lacks are fewer than ``threshold_tokens``
    (or the request cannot use the cache), else DISAGGREGATED with the full blocks to move.
    Full blocks never include the last prompt token: the decode engine computes it and
    samples, exactly as after a prefix hit."""
    num_prompt = len(request.prompt_token_ids)
    uncached = num_prompt - num_decode_cached_blocks * block_size
    end_block = (num_prompt - 1) // block_size
    if not can_disaggregate(request) or uncached < threshold_tokens or end_block <= num_decode_cached_blocks:
        return RouteDecision(Route.UNIFIED, uncached)
    return RouteDecision(Route.DISAGGREGATED, uncached, num_decode_cached_blocks, end_block)
