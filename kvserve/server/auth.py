"""Optional API keys: ``Authorization: Bearer <key>`` on every route but /health and /ready.

Keys map to tenant names (``--api-key`` gives tenant "default"; ``--api-keys-file``
holds one ``KEY TENANT [CLASS]`` line per key, or a JSON object whose values are a
tenant string or ``{"tenant": "...", "service_class": "..."}``). CLASS pins the
tenant to a latency class (``interactive``/``chat``/``batch`` or a service tier name):
its requests run in that class whatever ``service_tier`` they ask for.
A presented key is compared with every configured key in constant time, so the
answer's timing does not tell how much of a key matched, nor which key it was.
The tenant goes into ``scope["state"]["tenant"]`` for the engine (prefix-cache
isolation), the pinned class (None: not pinned) into ``scope["state"]["service_class"]``.

Admin routes (``/admin/*``, ``/v1/load_lora_adapter``, ``/v1/unload_lora_adapter``) sit
behind the same keys. With admin keys (``--admin-api-key``, the tenants file's
``admin_keys``) they need one of those instead: another configured key gets 403, a
missing or unknown one 401; ``/metrics`` becomes an admin route too (its series name
every tenant). An admin key opens only the admin routes.
"""
from __future__ import annotations

import hmac
import json
from dataclasses import dataclass

from kvserve.engine.service_class import ServiceClass, parse_class
from kvserve.server.errors import AuthenticationError, PermissionDeniedError

PUBLIC_PATHS = frozenset({"/health", "/ready", "/"})
CONSOLE_ASSET_PREFIX = "/console/"     # the web console's static files: public, they hold no data
CONSOLE_API_PREFIX = "/v1/console/"    # its status feed shows every tenant's load: guarded like /metrics
ADMIN_PATHS = frozenset({"/v1/load_lora_adapter", "/v1/unload_lora_adapter"})
ADMIN_PREFIX = "/admin/"
ADMIN_TENANT = "admin"
NO_AUTH_CACHE_SALT = "kvserve:no-auth"     # every request's salt when no keys are configured


METRICS_PATH = "/metrics"


def is_admin_path(path: str) -> bool:
    """Routes that change the server for everyone (the admin key's routes)."""
    return path.startswith(ADMIN_PREFIX) or path in ADMIN_PATHS


def cache_salt(tenant: str | None) -> str:
    """The prefix-cache salt of an authenticated caller: derived from its tenant (set by
    this middleware from the key), never from the request body; a fixed salt without auth."""
    return NO_AUTH_CACHE_SALT if tenant is None else "tenant:" + tenant


@dataclass(frozen=True)
class KeyGrant:
    """What an API key grants: its tenant and, optionally, the class its requests are pinned to."""

    tenant: str
    service_class: ServiceClass | None = None


def as_grant(value: KeyGrant | str) -> KeyGrant:
    """A configured key's grant (a bare string is a tenant without a pinned class)."""
    return value if isinstance(value, KeyGrant) else KeyGrant(value)


def load_keys(api_key: str | None = None, keys_file: str | None = None) -> dict[str, KeyGrant]:
    """key -> grant from the command line options (empty: authentication off)."""
    keys: dict[str, KeyGrant] = {}
    if api_key is not None:
        if not api_key.strip():
            raise ValueError("--api-key (or KVSERVE_API_KEY) is empty: an empty key would turn "
                             "authentication off; unset it to run without keys")
        keys[api_key] = KeyGrant("default")
    if keys_file:
        with open(keys_file, encoding="utf-8") as f:
            text = f.read()
        keys.update(_json_keys(text, keys_file) if text.lstrip().startswith("{") else _text_keys(text, keys_file))
    if any(not k for k in keys):
        raise ValueError("API keys must not be empty")
    return keys


def _text_keys(text: str, keys_file: str) -> dict[str, KeyGrant]:
    """``KEY TENANT [CLASS]`` lines; blank lines and ``#`` comments skipped."""
    keys = {}
    for number, line in enumerate(text.splitlines(), 1):
        parts = line.split()
        if not parts or parts[0].startswith("#"):
            continue
        if len(parts) not in (2, 3):
            raise ValueError(f"{keys_file}:{number}: expected 'KEY TENANT' or 'KEY TENANT CLASS'")
        try:
            pinned = parse_class(parts[2]) if len(parts) == 3 else None
        except ValueError as exc:
            raise ValueError(f"{keys_file}:{number}: {exc}") from None
        keys[parts[0]] = KeyGrant(parts[1], pinned)
    return keys


def _json_keys(text: str, keys_file: str) -> dict[str, KeyGrant]:
    """``{"KEY": "TENANT" | {"tenant": "TENANT", "service_class": CLASS | null}}``."""
    loaded = json.loads(text)
    expected = (f"{keys_file}: expected a JSON object of key -> tenant string or "
                '{"tenant": ..., "service_class": ...}')
    keys = {}
    for key, value in loaded.items():
        if isinstance(value, str):
            keys[key] = KeyGrant(value)
            continue
        if (not isinstance(value, dict) or not isinstance(value.get("tenant"), str)
                or set(value) - {"tenant", "service_class"}
                or not isinstance(value.get("service_class", ""), (str, type(None)))):
            raise ValueError(expected)
        name = value.get("service_class")
        try:
            keys[key] = KeyGrant(value["tenant"], parse_class(name) if name is not None else None)
        except ValueError as exc:
            raise ValueError(f"{keys_file}: key of tenant {value['tenant']!r}: {exc}") from None
    return keys


def bearer_token(authorization: bytes | None) -> bytes | None:
    """The key of an ``Authorization: Bearer KEY`` header, or None."""
    if not authorization:
        return None
    scheme, _, presented = authorization.partition(b" ")
    if scheme.lower() != b"bearer":
        return None
    return presented.strip()


def match_key(keys: dict[str, KeyGrant | str], authorization: bytes | None) -> KeyGrant | None:
    """The grant of a ``Bearer`` header's key, or None; compares against every key."""
    presented = bearer_token(authorization)
    if presented is None:
        return None
    grant = None
    for key, value in keys.items():
        if hmac.compare_digest(presented, key.encode("utf-8")):
            grant = as_grant(value)
    return grant


class AuthMiddleware:
    """ASGI middleware: 401 in the OpenAI error shape unless the key matches; with an
    admin key, admin routes need it (403 for another valid key). ``keys`` maps a key to
    its grant (or to a bare tenant name); ``admin_keys`` open the admin routes and
    /metrics (none: those routes take the ordinary keys)."""

    def __init__(self, app, keys: dict[str, KeyGrant | str], admin_keys: tuple[str, ...] = ()):
        self.app = app
        self.keys = {key: as_grant(value) for key, value in keys.items()}
        self.admin_keys = tuple(key.encode("utf-8") for key in admin_keys)

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        state = scope.setdefault("state", {})
        state["tenant"] = None
        state["service_class"] = None
        path = scope["path"]
        if self.admin_keys and (is_admin_path(path) or path == METRICS_PATH or path.startswith(CONSOLE_API_PREFIX)):
            header = next((v for k, v in scope["headers"] if k == b"authorization"), None)
            refusal = self._check_admin(header)
            if refusal is not None:
                headers = [(b"www-authenticate", b"Bearer")] if refusal.http_status == 401 else []
                return await _send_json(send, refusal.http_status, refusal.to_dict(), headers)
            state["tenant"] = ADMIN_TENANT
            return await self.app(scope, receive, send)
        if self.keys and path not in PUBLIC_PATHS and not path.startswith(CONSOLE_ASSET_PREFIX):
            header = next((v for k, v in scope["headers"] if k == b"authorization"), None)
            grant = match_key(self.keys, header)
            if grant is None:
                message = ("missing API key: send 'Authorization: Bearer <key>'" if header is None
                           else "invalid API key")
                return await _send_json(send, 401, AuthenticationError(message).to_dict(),
                                        [(b"www-authenticate", b"Bearer")])
            state["tenant"] = grant.tenant
            state["service_class"] = grant.service_class
        return await self.app(scope, receive, send)

    def _check_admin(self, header: bytes | None):
        """None if the header carries the admin key; else the error to answer with."""
        presented = bearer_token(header)
        if presented is not None and _matches_any(presented, self.admin_keys):
            return None
        if match_key(self.keys, header) is not None:
            return PermissionDeniedError("this route needs an admin API key (--admin-api-key or the "
                                         "tenants file's admin_keys)")
        return AuthenticationError("missing API key: send 'Authorization: Bearer <admin key>'" if header is None
                                   else "invalid API key")


def _matches_any(presented: bytes, keys: tuple[bytes, ...]) -> bool:
    """Whether ``presented`` is one of ``keys``, compared with each in constant time."""
    found = False
    for key in keys:
        found |= hmac.compare_digest(presented, key)
    return found


async def _send_json(send, status: int, body: dict, extra_headers: list) -> None:
    payload = json.dumps(body).encode("utf-8")
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(payload)).encode()),
               *extra_headers]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": payload})
