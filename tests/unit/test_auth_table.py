"""Every route x {no key, wrong key, own key, other tenant's key, admin key}: the status
the auth layer gives (tier 1: the app in-process, no engine). The routes are enumerated
from the app itself, so a new route cannot be left out of the table."""
from __future__ import annotations

import pytest
from fastapi import FastAPI
from starlette.testclient import TestClient

from kvserve.server.app import ServingContext, build_app
from kvserve.server.auth import KeyGrant
from kvserve.server.metrics import ServerMetrics
from kvserve.server.state import AdmissionLimits, ServerState
from kvserve.server.tenancy import Tenancy
from kvserve.server.tenants import parse_tenants

TENANTS = {"admin_keys": ["admin-key"],
           "tenants": {"alice": {"keys": ["alice-key"], "limits": {"requests_per_min": 1000}},
                       "bob": {"keys": ["bob-key"]}}}
PUBLIC = {"/health", "/ready", "/", "/console/{name}"}          # the console page and assets hold no data
ADMIN = {"/admin/reset_prefix_cache", "/admin/drain", "/admin/load_weights", "/admin/sleep", "/admin/wake",
         "/v1/load_lora_adapter", "/v1/unload_lora_adapter",
         "/metrics", "/v1/console/status", "/v1/console/events"}
TENANT = {"/v1/completions", "/v1/chat/completions", "/v1/models", "/v1/models/{model_id:path}", "/tokenize",
          "/detokenize", "/tokenizer_info", "/openapi.json"}
CALLERS = {"none": None, "wrong": "not-a-key", "own": "alice-key", "other": "bob-key", "admin": "admin-key"}


def _app():
    config = parse_tenants(TENANTS)
    keys = {k: KeyGrant(name) for name, t in config.tenants.items() for k in t.keys}
    ctx = ServingContext(tokenizer=None, model_name="m", model_aliases=frozenset({"m"}),
                         state=ServerState(AdmissionLimits()), metrics=ServerMetrics(), api_keys=keys,
                         admin_keys=config.admin_keys, tenancy=Tenancy.from_config(config))
    return build_app(ctx)


def _routes(asgi) -> dict[str, set[str]]:
    """path -> methods of the FastAPI app under the middlewares."""
    app = asgi
    while not isinstance(app, FastAPI):
        app = app.app
    return {route.path: set(route.methods) for route in app.routes if hasattr(route, "methods")}


def _expected(path: str, caller: str) -> str:
    """'401', '403' or 'pass' (past the auth layer: whatever the route answers)."""
    if path in PUBLIC:
        return "pass"
    if caller in ("none", "wrong"):
        return "401"
    if path in ADMIN:
        return "pass" if caller == "admin" else "403"
    return "401" if caller == "admin" else "pass"      # an admin key opens only the admin routes


def test_every_route_is_in_the_table():
    assert set(_routes(_app())) == PUBLIC | ADMIN | TENANT


@pytest.mark.parametrize("caller", sorted(CALLERS))
def test_route_key_table(caller):
    asgi = _app()
    seen = {}
    with TestClient(asgi, raise_server_exceptions=False) as client:
        for path, methods in sorted(_routes(asgi).items()):
            for method in sorted(methods - {"HEAD"}):
                key = CALLERS[caller]
                headers = {"Authorization": f"Bearer {key}"} if key else {}
                r = client.request(method, path, headers=headers, json={} if method == "POST" else None)
                got = str(r.status_code) if r.status_code in (401, 403) else "pass"
                seen[(method, path)] = got
                assert got == _expected(path, caller), (method, path, caller, r.status_code, r.text[:200])
                assert r.status_code < 500 or r.status_code == 503, (method, path, r.status_code, r.text[:200])
                if r.status_code in (401, 403):
                    assert set(r.json()["error"]) == {"message", "type", "param", "code"}
                if caller == "own" and got == "pass" and path not in PUBLIC:   # alice is limited: headers
                    assert r.headers["x-ratelimit-limit-requests"] == "1000"
                if caller == "other":                                  # bob is not: no headers
                    assert "x-ratelimit-limit-requests" not in r.headers
    assert len(seen) >= len(PUBLIC | ADMIN | TENANT)
