"""Cluster-wide tenant rate limits, enforced once at the ingress (docs/cluster.md).

Each replica's front end enforces the tenants file's limits on the traffic it sees; with
N replicas a tenant would get N times its limit. ``FleetLimits`` holds one
``kvserve.server.rate_limit.RateLimiter`` (the single server's, through its ``Tenancy``)
for the whole fleet and applies it to every generation request before it is routed:

- concurrency and requests per minute: exactly the server's ``admit``; the concurrency
  slot is held until the relayed answer ends (queue wait at the ingress included);
- tokens per minute: the server's ``reserve_tokens`` on an estimate made from the body —
  the prompt's tokens (the router's token ids, times the number of prompts) plus
  ``n x max_tokens``, where a body without a length gets the tenant's (or the server's)
  ``default_max_tokens`` / ``max_tokens`` cap (completions: OpenAI's 16 within them); with
  no cap at all only the prompt is reserved. When the answer ends the reservation is
  settled to the ``usage.total_tokens`` the answer reported (a non-streamed body, or a
  stream with ``include_usage``), to the whole reservation when it reported none, and to
  nothing for an error answer (the request never ran).

Refusals are the single server's: 429 with the same error body, ``Retry-After`` and
``x-ratelimit-*`` headers (400 for a request over the whole token bucket); every answer to
a limited tenant carries the fleet's ``x-ratelimit-*`` headers in place of the replica's.
"""
from __future__ import annotations

import re

from starlette.responses import JSONResponse

from kvserve.errors import KVServeError
from kvserve.server.rate_limit import Ticket
from kvserve.server.tenancy import Tenancy
from kvserve.server.tenants import TenantLimits, TenantsConfig

COMPLETION_DEFAULT_MAX_TOKENS = 16          # OpenAI's completions default (the server's protocol.py)
USAGE_TAIL_BYTES = 4096                     # the end of an answer that holds its usage
_TOTAL_TOKENS = re.compile(rb'"total_tokens"\s*:\s*(\d+)')
RATE_LIMIT_HEADER_PREFIX = "x-ratelimit-"


class FleetLimits:
    """The tenants file's rate limits for the whole fleet; ``default_max_tokens`` and
    ``max_tokens_limit`` are the replicas' server-wide caps (``--default-max-tokens``,
    ``--max-tokens-limit``), which the token estimate follows."""

    def __init__(self, limits: dict[str, TenantLimits], default_max_tokens: int | None = 2048,
                 max_tokens_limit: int | None = None, clock=None):
        from kvserve.server.rate_limit import RateLimiter
        from kvserve.server.tenants import Tenant
        # the Tenancy needs Tenant records only for their limits (caps); keys stay with the auth
        tenants = {name: Tenant(name, ("-",), limits=lim) for name, lim in limits.items()}
        limiter = RateLimiter(dict(limits)) if clock is None else RateLimiter(dict(limits), clock=clock)
        self.tenancy = Tenancy(tenants, limiter)
        self.default_max_tokens = default_max_tokens
        self.max_tokens_limit = max_tokens_limit

    @classmethod
    def enforced(cls, limits: dict[str, TenantLimits], default_max_tokens: int | None = 2048,
                 max_tokens_limit: int | None = None) -> "FleetLimits | None":
        """The fleet's limits for ``limits`` (tenant -> its limits); None when they limit nobody."""
        fleet = cls(limits, default_max_tokens, max_tokens_limit)
        return fleet if fleet.tenancy.limiter.has_limits else None

    @classmethod
    def from_config(cls, config: TenantsConfig | None, default_max_tokens: int | None = 2048,
                    max_tokens_limit: int | None = None) -> "FleetLimits | None":
        """The limits of a tenants file; None when it limits nobody (nothing to enforce)."""
        limits = {name: t.limits for name, t in (config.tenants if config is not None else {}).items()}
        return cls.enforced(limits, default_max_tokens, max_tokens_limit)

    def admit(self, tenant: str | None, path: str, values: dict | None, num_prompt_tokens: int) -> Ticket:
        """Admit one generation request (``values``: its JSON body, None when it did not parse)
        or raise the server's ``RateLimitError`` (429) / ``InvalidRequestError`` (400). The
        ticket is settled by ``settle``, once."""
        limiter = self.tenancy.limiter
        ticket = limiter.admit(tenant)
        try:
            limiter.reserve_tokens(ticket, self.estimate_tokens(tenant, path, values or {}, num_prompt_tokens))
        except BaseException:
            limiter.settle(ticket)
            raise
        return ticket

    def estimate_tokens(self, tenant: str | None, path: str, values: dict, num_prompt_tokens: int) -> int:
        """The most tokens this request may use, as far as the ingress can tell (module doc)."""
        prompt = values.get("prompt")
        num_prompts = len(prompt) if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int) else 1
        asked = values.get("max_completion_tokens") or values.get("max_tokens")
        if not isinstance(asked, int):
            caps = self.tenancy.caps(tenant, self.default_max_tokens, self.max_tokens_limit)
            implicit = COMPLETION_DEFAULT_MAX_TOKENS if path.endswith("/v1/completions") else None
            asked = min((x for x in (implicit, caps.default_max_tokens, caps.max_tokens_limit) if x is not None),
                        default=0)
        n = values.get("n") if isinstance(values.get("n"), int) and values.get("n") > 0 else 1
        return num_prompts * (num_prompt_tokens + n * asked)

    def settle(self, ticket: Ticket, status: int, tail: bytes) -> None:
        """The answer ended with ``status``; ``tail`` is its last bytes (``UsageTail``)."""
        if status >= 400:
            used = None                                  # refused or failed: it never ran
        else:
            found = _TOTAL_TOKENS.findall(tail)
            used = int(found[-1]) if found else ticket.num_reserved_tokens
        self.tenancy.limiter.settle(ticket, used)

    def headers(self, tenant: str | None) -> dict[str, str]:
        """The fleet's ``x-ratelimit-*`` headers for ``tenant`` (empty when unlimited)."""
        return self.tenancy.limiter.headers(tenant)

    def with_headers(self, tenant: str | None, headers: dict[str, str]) -> dict[str, str]:
        """A forwarded answer's headers with the replica's ``x-ratelimit-*`` replaced by the fleet's."""
        mine = self.headers(tenant)
        if not mine:
            return headers
        kept = {k: v for k, v in headers.items() if not k.lower().startswith(RATE_LIMIT_HEADER_PREFIX)}
        return {**kept, **mine}

    def refusal(self, err: KVServeError, tenant: str | None) -> JSONResponse:
        """The single server's answer to a refused request: its error body and status,
        ``Retry-After`` when the error has one, and the tenant's ``x-ratelimit-*``."""
        headers = dict(self.headers(tenant))
        retry_after_s = getattr(err, "retry_after_s", None)
        if retry_after_s is not None:
            headers["Retry-After"] = str(retry_after_s)
        return JSONResponse(err.to_dict(), status_code=err.http_status, headers=headers)


class UsageTail:
    """The last ``USAGE_TAIL_BYTES`` of a relayed answer (where its usage is)."""

    def __init__(self):
        self.data = b""

    def add(self, chunk) -> None:
        """Keep ``chunk`` (bytes or str) at the end."""
        raw = chunk.encode() if isinstance(chunk, str) else bytes(chunk)
        self.data = (self.data + raw)[-USAGE_TAIL_BYTES:]
