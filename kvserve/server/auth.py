"""Optional API keys: ``Authorization: Bearer <key>`` on every route but /health and /ready.

Keys map to tenant names (``--api-key`` gives tenant "default"; ``--api-keys-file``
holds one ``KEY TENANT`` pair per line, or a JSON object ``{"KEY": "TENANT"}``).
A presented key is compared with every configured key in constant time, so the
answer's timing does not tell how much of a key matched, nor which key it was.
The tenant goes into ``scope["state"]["tenant"]`` for the engine (prefix-cache
isolation).

Admin routes (``/admin/*``, ``/v1/load_lora_adapter``, ``/v1/unload_lora_adapter``) sit
behind the same keys. With ``--admin-api-key`` they need that key instead: another
configured key gets 403, a missing or unknown one 401. The admin key opens only the
admin routes.
"""
from __future__ import annotations

import hmac
import json

from kvserve.server.errors import AuthenticationError, PermissionDeniedError

PUBLIC_PATHS = frozenset({"/health", "/ready"})
ADMIN_PATHS = frozenset({"/v1/load_lora_adapter", "/v1/unload_lora_adapter"})
ADMIN_PREFIX = "/admin/"
ADMIN_TENANT = "admin"
NO_AUTH_CACHE_SALT = "kvserve:no-auth"     # every request's salt when no keys are configured


def is_admin_path(path: str) -> bool:
    """Routes that change the server for everyone (the admin key's routes)."""
    return path.startswith(ADMIN_PREFIX) or path in ADMIN_PATHS


def cache_salt(tenant: str | None) -> str:
    """The prefix-cache salt of an authenticated caller: derived from its tenant (set by
    this middleware from the key), never from the request body; a fixed salt without auth."""
    return NO_AUTH_CACHE_SALT if tenant is None else "tenant:" + tenant


def load_keys(api_key: str | None = None, keys_file: str | None = None) -> dict[str, str]:
    """key -> tenant from the command line options (empty: authentication off)."""
    keys: dict[str, str] = {}
    if api_key:
        keys[api_key] = "default"
    if keys_file:
        with open(keys_file, encoding="utf-8") as f:
            text = f.read()
        if text.lstrip().startswith("{"):
            loaded = json.loads(text)
            if not all(isinstance(k, str) and isinstance(v, str) for k, v in loaded.items()):
                raise ValueError(f"{keys_file}: expected a JSON object of key -> tenant strings")
            keys.update(loaded)
        else:
            for number, line in enumerate(text.splitlines(), 1):
                parts = line.split()
                if not parts or parts[0].startswith("#"):
                    continue
                if len(parts) != 2:
                    raise ValueError(f"{keys_file}:{number}: expected 'KEY TENANT'")
                keys[parts[0]] = parts[1]
    if any(not k for k in keys):
        raise ValueError("API keys must not be empty")
    return keys


def bearer_token(authorization: bytes | None) -> bytes | None:
    """The key of an ``Authorization: Bearer KEY`` header, or None."""
    if not authorization:
        return None
    scheme, _, presented = authorization.partition(b" ")
    if scheme.lower() != b"bearer":
        return None
    return presented.strip()


def match_key(keys: dict[str, str], authorization: bytes | None) -> str | None:
    """The tenant of a ``Bearer`` header's key, or None; compares against every key."""
    presented = bearer_token(authorization)
    if presented is None:
        return None
    tenant = None
    for key, name in keys.items():
        if hmac.compare_digest(presented, key.encode("utf-8")):
            tenant = name
    return tenant


class AuthMiddleware:
    """ASGI middleware: 401 in the OpenAI error shape unless the key matches; with an
    admin key, admin routes need it (403 for another valid key)."""

    def __init__(self, app, keys: dict[str, str], admin_key: str | None = None):
        self.app = app
        self.keys = dict(keys)
        self.admin_key = admin_key.encode("utf-8") if admin_key else None

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        state = scope.setdefault("state", {})
        state["tenant"] = None
        if self.admin_key is not None and is_admin_path(scope["path"]):
            header = next((v for k, v in scope["headers"] if k == b"authorization"), None)
            refusal = self._check_admin(header)
            if refusal is not None:
                headers = [(b"www-authenticate", b"Bearer")] if refusal.http_status == 401 else []
                return await _send_json(send, refusal.http_status, refusal.to_dict(), headers)
            state["tenant"] = ADMIN_TENANT
            return await self.app(scope, receive, send)
        if self.keys and scope["path"] not in PUBLIC_PATHS:
            header = next((v for k, v in scope["headers"] if k == b"authorization"), None)
            tenant = match_key(self.keys, header)
            if tenant is None:
                message = ("missing API key: send 'Authorization: Bearer <key>'" if header is None
                           else "invalid API key")
                return await _send_json(send, 401, AuthenticationError(message).to_dict(),
                                        [(b"www-authenticate", b"Bearer")])
            state["tenant"] = tenant
        return await self.app(scope, receive, send)

    def _check_admin(self, header: bytes | None):
        """None if the header carries the admin key; else the error to answer with."""
        presented = bearer_token(header)
        if presented is not None and hmac.compare_digest(presented, self.admin_key):
            return None
        if match_key(self.keys, header) is not None:
            return PermissionDeniedError("this route needs the admin API key (--admin-api-key)")
        return AuthenticationError("missing API key: send 'Authorization: Bearer <admin key>'" if header is None
                                   else "invalid API key")


async def _send_json(send, status: int, body: dict, extra_headers: list) -> None:
    payload = json.dumps(body).encode("utf-8")
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(payload)).encode()),
               *extra_headers]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": payload})
