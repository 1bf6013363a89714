"""Optional API keys: ``Authorization: Bearer <key>`` on every route but /health and /ready.

Keys map to tenant names (``--api-key`` gives tenant "default"; ``--api-keys-file``
holds one ``KEY TENANT`` pair per line, or a JSON object ``{"KEY": "TENANT"}``).
A presented key is compared with every configured key in constant time, so the
answer's timing does not tell how much of a key matched, nor which key it was.
The tenant goes into ``scope["state"]["tenant"]`` for the engine (prefix-cache
isolation).
"""
from __future__ import annotations

import hmac
import json

from kvserve.server.errors import AuthenticationError

PUBLIC_PATHS = frozenset({"/health", "/ready"})
NO_AUTH_CACHE_SALT = "kvserve:no-auth"     # every request's salt when no keys are configured


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


def match_key(keys: dict[str, str], authorization: bytes | None) -> str | None:
    """The tenant of a ``Bearer`` header's key, or None; compares against every key."""
    if not authorization:
        return None
    scheme, _, presented = authorization.partition(b" ")
    if scheme.lower() != b"bearer":
        return None
    presented = presented.strip()
    tenant = None
    for key, name in keys.items():
        if hmac.compare_digest(presented, key.encode("utf-8")):
            tenant = name
    return tenant


class AuthMiddleware:
    """ASGI middleware: 401 in the OpenAI error shape unless the key matches."""

    def __init__(self, app, keys: dict[str, str]):
        self.app = app
        self.keys = dict(keys)

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        state = scope.setdefault("state", {})
        state["tenant"] = None
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


async def _send_json(send, status: int, body: dict, extra_headers: list) -> None:
    payload = json.dumps(body).encode("utf-8")
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(payload)).encode()),
               *extra_headers]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": payload})
