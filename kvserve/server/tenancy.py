"""What the tenants file does to a request in the HTTP process: which models a tenant may
use, its generation-length caps and prompt limit, its rate limits (``rate_limit.py``),
the guards that see its traffic (``kvserve/guards``) and the audit log (``audit.py``).

Without a tenants file a ``Tenancy`` holds no tenants: nothing is limited or guarded,
and only the server-wide caps apply.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from kvserve.errors import InvalidRequestError
from kvserve.server.audit import AuditLog, AuditRecord
from kvserve.server.errors import PermissionDeniedError
from kvserve.server.rate_limit import RateLimiter, Ticket
from kvserve.server.tenants import Tenant, TenantsConfig


@dataclass(frozen=True)
class GenerationCaps:
    """A request's generation-length rules: the default for a request without max_tokens
    and the most it may ask (None: no such rule)."""

    default_max_tokens: int | None
    max_tokens_limit: int | None


@dataclass
class Tenancy:
    """The per-tenant rules of one server (empty without a tenants file)."""

    tenants: dict[str, Tenant] = field(default_factory=dict)
    limiter: RateLimiter = field(default_factory=lambda: RateLimiter({}))
    guard_sets: dict[str, object] = field(default_factory=dict)   # tenant -> kvserve.guards GuardSet
    audit: AuditLog | None = None

    @classmethod
    def from_config(cls, config: TenantsConfig | None, guard_sets: dict[str, object] | None = None,
                    audit_path: str | None = None) -> "Tenancy":
        """The rules of a tenants file (None: none); ``audit_path`` overrides the file's."""
        tenants = dict(config.tenants) if config is not None else {}
        path = audit_path or (config.audit_log if config is not None else None)
        return cls(tenants, RateLimiter({name: t.limits for name, t in tenants.items()}), dict(guard_sets or {}),
                   AuditLog(path) if path else None)

    def tenant(self, name: str | None) -> Tenant | None:
        return self.tenants.get(name) if name is not None else None

    def check_model(self, tenant: str | None, adapter: str | None, base_names: frozenset[str]) -> None:
        """403 when the tenant's ``models`` list names neither the adapter it selected nor
        (for the base model, ``adapter`` None) any of the base model's names."""
        config = self.tenant(tenant)
        if config is None:
            return
        names = (adapter,) if adapter is not None else tuple(base_names)
        if not any(config.may_use(name) for name in names):
            raise PermissionDeniedError(f"tenant {tenant!r} may not use model {adapter or min(base_names)!r}",
                                        param="model", code="model_not_allowed")

    def caps(self, tenant: str | None, default_max_tokens: int | None, max_tokens_limit: int | None
             ) -> GenerationCaps:
        """The server-wide caps narrowed by the tenant's ``default_max_tokens`` / ``max_tokens``."""
        config = self.tenant(tenant)
        if config is None:
            return GenerationCaps(default_max_tokens, max_tokens_limit)
        limits = config.limits
        limit = min((x for x in (max_tokens_limit, limits.max_tokens) if x is not None), default=None)
        default = limits.default_max_tokens or default_max_tokens
        if default is not None and limit is not None:
            default = min(default, limit)
        return GenerationCaps(default, limit)

    def check_prompt_tokens(self, tenant: str | None, num_prompt_tokens: int, param: str) -> None:
        """400 when a prompt is longer than the tenant's ``max_prompt_tokens``."""
        config = self.tenant(tenant)
        limit = config.limits.max_prompt_tokens if config is not None else None
        if limit is not None and num_prompt_tokens > limit:
            raise InvalidRequestError(f"the prompt has {num_prompt_tokens} tokens; tenant {tenant!r} may send "
                                      f"at most {limit}", param=param, code="prompt_tokens_limit_exceeded")

    def guards(self, tenant: str | None):
        """The tenant's GuardSet, or None when no guard sees its traffic."""
        return self.guard_sets.get(tenant) if tenant is not None else None

    def keeps_text(self, tenant: str | None) -> bool:
        """Whether the audit log keeps this tenant's prompt and output text."""
        config = self.tenant(tenant)
        return config is not None and config.audit_text


@dataclass
class RequestAccount:
    """One generation request's hold on its tenant's limits and its audit record; ``end``
    settles the one and writes the other, once, however the request ended."""

    tenancy: Tenancy
    record: AuditRecord
    metrics: object = None                 # ServerMetrics (its ``tenants`` part), or None
    ticket: Ticket | None = None
    ended: bool = False

    def end(self, num_used_tokens: int | None = None) -> None:
        """The request ended having used ``num_used_tokens`` (None: it never ran)."""
        if self.ended:
            return
        self.ended = True
        record = self.record
        if self.ticket is not None:
            self.tenancy.limiter.settle(self.ticket, num_used_tokens)
        if self.tenancy.audit is not None:
            self.tenancy.audit.write(record)
        if self.metrics is not None:
            self.metrics.tenants.observe_request(record.tenant, record.status, record.error_code,
                                                 record.prompt_tokens, record.completion_tokens)


class RateLimitHeaders:
    """ASGI middleware (inside the auth middleware, which names the tenant): adds the
    tenant's ``x-ratelimit-*`` headers to every response it gets."""

    def __init__(self, app, limiter: RateLimiter):
        self.app = app
        self.limiter = limiter

    async def __call__(self, scope, receive, send):
        tenant = scope.get("state", {}).get("tenant") if scope["type"] == "http" else None
        if tenant is None:
            return await self.app(scope, receive, send)

        async def send_with_headers(message):
            if message["type"] == "http.response.start":
                extra = [(k.encode("latin-1"), v.encode("latin-1")) for k, v in self.limiter.headers(tenant).items()]
                if extra:
                    message = {**message, "headers": [*message.get("headers", []), *extra]}
            await send(message)
        return await self.app(scope, receive, send_with_headers)
