"""Per-tenant rate limits, enforced in the HTTP process before the engine sees a request.

Each limited tenant has up to two token buckets and a counter:

- requests per minute: a bucket of ``requests_per_min`` that refills at ``limit / 60``
  per second; every authenticated request that reaches the check takes one (a burst
  of 2x the limit lets exactly ``limit`` through, then one per ``60 / limit`` seconds);
- tokens per minute: a bucket of ``tokens_per_min``; a request reserves its prompt
  tokens plus the most it may generate (``n x max_tokens`` per prompt) at admission
  and is settled to what it really used when it ends (the unused part goes back);
- concurrent requests: admitted and not yet ended.

Over a limit: 429 with ``Retry-After`` (seconds until the bucket holds enough). A
request that could never pass (more tokens than the bucket holds) is a 400 instead:
waiting would not help. Every response of a limited tenant carries OpenAI's headers
``x-ratelimit-{limit,remaining,reset}-{requests,tokens}``.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Callable

from kvserve.errors import InvalidRequestError, KVServeError
from kvserve.server.tenants import TenantLimits


class RateLimitError(KVServeError):
    """A tenant's limit refused the request (429, with Retry-After)."""

    http_status = 429
    error_type = "requests"
    code = "rate_limit_exceeded"

    def __init__(self, message: str, kind: str, retry_after_s: float, code: str = "rate_limit_exceeded"):
        super().__init__(message, code=code)
        self.error_type = kind                      # "requests" or "tokens", as OpenAI names them
        self.retry_after_s = max(1, math.ceil(retry_after_s))


@dataclass
class TokenBucket:
    """``capacity`` units, refilled continuously at ``capacity / 60`` per second."""

    capacity: float
    level: float
    updated: float

    @classmethod
    def per_minute(cls, limit: int, now: float) -> "TokenBucket":
        return cls(float(limit), float(limit), now)

    @property
    def refill_per_s(self) -> float:
        return self.capacity / 60.0

    def _refill(self, now: float) -> None:
        self.level = min(self.capacity, self.level + max(0.0, now - self.updated) * self.refill_per_s)
        self.updated = now

    def try_take(self, amount: float, now: float) -> bool:
        """Take ``amount`` if the bucket holds it; False (nothing taken) otherwise."""
        self._refill(now)
        if self.level + 1e-9 < amount:
            return False
        self.level -= amount
        return True

    def give_back(self, amount: float, now: float) -> None:
        """Return ``amount`` (a negative amount takes more: usage above the reservation)."""
        self._refill(now)
        self.level = min(self.capacity, self.level + amount)

    def remaining(self, now: float) -> int:
        self._refill(now)
        return max(0, int(self.level))

    def seconds_until(self, amount: float, now: float) -> float:
        """Seconds until the bucket holds ``amount``."""
        self._refill(now)
        return max(0.0, amount - self.level) / self.refill_per_s

    def seconds_until_full(self, now: float) -> float:
        return self.seconds_until(self.capacity, now)


@dataclass
class Ticket:
    """One admitted request's hold on its tenant's limits; ``settle`` once when it ends."""

    tenant: str | None
    num_reserved_tokens: int = 0
    holds_slot: bool = False
    settled: bool = False


class _TenantState:
    def __init__(self, limits: TenantLimits, now: float):
        self.limits = limits
        self.requests = TokenBucket.per_minute(limits.requests_per_min, now) if limits.requests_per_min else None
        self.tokens = TokenBucket.per_minute(limits.tokens_per_min, now) if limits.tokens_per_min else None
        self.num_concurrent = 0


class RateLimiter:
    """The limits of every tenant (tenants without limits pass untouched)."""

    def __init__(self, limits: dict[str, TenantLimits], clock: Callable[[], float] = time.monotonic):
        self.clock = clock
        now = clock()
        self._tenants = {name: _TenantState(lim, now) for name, lim in limits.items()
                         if lim.requests_per_min or lim.tokens_per_min or lim.max_concurrent_requests}

    @property
    def has_limits(self) -> bool:
        """Whether any tenant is limited at all."""
        return bool(self._tenants)

    def admit(self, tenant: str | None) -> Ticket:
        """Concurrency, then requests per minute; RateLimitError when over. The ticket holds
        a concurrency slot until ``settle``."""
        ticket = Ticket(tenant)
        state = self._tenants.get(tenant)
        if state is None:
            return ticket
        now = self.clock()
        cap = state.limits.max_concurrent_requests
        if cap is not None and state.num_concurrent >= cap:
            raise RateLimitError(f"tenant {tenant!r} has {state.num_concurrent} requests in flight; its limit "
                                 f"is {cap} concurrent requests", "requests", 1.0, code="concurrency_limit_exceeded")
        if state.requests is not None and not state.requests.try_take(1, now):
            wait = state.requests.seconds_until(1, now)
            raise RateLimitError(f"rate limit reached for tenant {tenant!r} on requests per minute: limit "
                                 f"{state.limits.requests_per_min}; retry in {wait:.1f} s", "requests", wait)
        if cap is not None:
            state.num_concurrent += 1
            ticket.holds_slot = True
        return ticket

    def reserve_tokens(self, ticket: Ticket, num_tokens: int) -> None:
        """Reserve prompt + maximum generated tokens; 429 when the bucket is short now,
        400 when the request needs more than the bucket ever holds."""
        state = self._tenants.get(ticket.tenant)
        if state is None or state.tokens is None:
            return
        limit = state.limits.tokens_per_min
        if num_tokens > limit:
            raise InvalidRequestError(f"the request needs up to {num_tokens} tokens (prompt + max_tokens); tenant "
                                      f"{ticket.tenant!r} may use at most {limit} tokens per minute: lower "
                                      "max_tokens", param="max_tokens", code="tokens_per_min_exceeded")
        now = self.clock()
        if not state.tokens.try_take(num_tokens, now):
            wait = state.tokens.seconds_until(num_tokens, now)
            raise RateLimitError(f"rate limit reached for tenant {ticket.tenant!r} on tokens per minute: limit "
                                 f"{limit}, requested {num_tokens}; retry in {wait:.1f} s", "tokens", wait)
        ticket.num_reserved_tokens = num_tokens

    def settle(self, ticket: Ticket, num_used_tokens: int | None = None) -> None:
        """The request ended: give back its concurrency slot and the reserved tokens it did
        not use (``num_used_tokens`` None: it never ran, all of them). Idempotent."""
        if ticket.settled:
            return
        ticket.settled = True
        state = self._tenants.get(ticket.tenant)
        if state is None:
            return
        if ticket.holds_slot:
            state.num_concurrent -= 1
        if state.tokens is not None and ticket.num_reserved_tokens:
            used = 0 if num_used_tokens is None else num_used_tokens
            state.tokens.give_back(ticket.num_reserved_tokens - used, self.clock())

    def headers(self, tenant: str | None) -> dict[str, str]:
        """OpenAI's rate-limit headers for the tenant's limits now (empty when unlimited)."""
        state = self._tenants.get(tenant)
        if state is None:
            return {}
        now, headers = self.clock(), {}
        for kind, bucket in (("requests", state.requests), ("tokens", state.tokens)):
            if bucket is not None:
                headers[f"x-ratelimit-limit-{kind}"] = str(int(bucket.capacity))
                headers[f"x-ratelimit-remaining-{kind}"] = str(bucket.remaining(now))
                headers[f"x-ratelimit-reset-{kind}"] = format_reset(bucket.seconds_until_full(now))
        return headers

    def num_concurrent(self, tenant: str | None) -> int:
        state = self._tenants.get(tenant)
        return state.num_concurrent if state is not None else 0


def format_reset(seconds: float) -> str:
    """A duration as OpenAI writes it in ``x-ratelimit-reset-*``: ``12ms``, ``1.5s``, ``6m0s``."""
    if seconds < 1.0:
        return f"{int(seconds * 1000)}ms"
    if seconds < 60.0:
        return f"{seconds:.3g}s"
    minutes, rest = divmod(seconds, 60.0)
    return f"{int(minutes)}m{int(rest)}s"
