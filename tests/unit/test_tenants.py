"""The tenants file and the per-tenant rate limiter (tier 1: pure, a fake clock)."""
from __future__ import annotations

import pathlib

import pytest

from kvserve.errors import InvalidRequestError
from kvserve.server.rate_limit import RateLimiter, RateLimitError, format_reset
from kvserve.server.tenancy import Tenancy
from kvserve.server.tenants import TenantLimits, TenantsFileError, load_tenants, parse_tenants

EXAMPLE = pathlib.Path(__file__).resolve().parents[2] / "examples" / "tenants.toml"


class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


# ------------------------------------------------------------------ the file
def test_shipped_example_loads_as_the_issue_describes():
    config = load_tenants(str(EXAMPLE))
    assert config.admin_keys == ("admin-key",)
    alice, bob = config.tenants["alice"], config.tenants["bob"]
    assert alice.keys == ("alice-key",) and alice.limits.requests_per_min == 5
    assert bob.keys == ("bob-key",) and bob.limits.requests_per_min is None
    assert "blockme" in alice.guards and "blockme" in bob.guards
    assert config.guards["blockme"]["type"] == "rules"


@pytest.mark.parametrize("text, field", [
    ('[tenants.a]\nkeys = ["k"]\nwieght = 2\n', "tenants.a.wieght"),
    ('[tenants.a]\nkeys = []\n', "tenants.a.keys"),
    ('[tenants.a]\nkeys = ["k"]\nweight = -1\n', "tenants.a.weight"),
    ('[tenants.a]\nkeys = ["k"]\n[tenants.a.limits]\nrequests_per_min = 0\n', "tenants.a.limits.requests_per_min"),
    ('[tenants.a]\nkeys = ["k"]\n[tenants.a.limits]\nrpm = 5\n', "tenants.a.limits.rpm"),
    ('[tenants.a]\nkeys = ["k"]\nservice_class = "vip"\n', "tenants.a.service_class"),
    ('[tenants.a]\nkeys = ["k"]\nguards = ["nope"]\n', "tenants.a.guards"),
    ('[tenants.a]\nkeys = ["k"]\n[tenants.b]\nkeys = ["k"]\n', "tenants.b.keys"),
    ('admin_keys = ["k"]\n[tenants.a]\nkeys = ["k"]\n', "tenants.a.keys"),
    ('[tenants.a]\nkeys = [" k"]\n', "tenants.a.keys"),
    ('colour = 1\n[tenants.a]\nkeys = ["k"]\n', "colour"),
    ('[tenants]\n', "tenants"),
])
def test_bad_file_names_the_field(tmp_path, text, field):
    path = tmp_path / "t.toml"
    path.write_text(text)
    with pytest.raises(TenantsFileError) as err:
        load_tenants(str(path))
    assert str(path) in str(err.value) and field in str(err.value)


def test_syntax_error_names_the_line(tmp_path):
    path = tmp_path / "t.toml"
    path.write_text('[tenants.a]\nkeys = ["k"\nweight = 1\n')
    with pytest.raises(TenantsFileError, match="line 3"):
        load_tenants(str(path))


def test_yaml_file(tmp_path):
    path = tmp_path / "t.yaml"
    path.write_text("admin_keys: [root]\ntenants:\n  a:\n    keys: [ka]\n    weight: 3\n"
                    "    limits: {tokens_per_min: 100}\n")
    config = load_tenants(str(path))
    assert config.tenants["a"].weight == 3.0 and config.tenants["a"].limits.tokens_per_min == 100
    assert config.weights() == {"a": 3.0}


def test_model_allow_list_and_caps():
    config = parse_tenants({"tenants": {
        "a": {"keys": ["ka"], "models": ["base", "ad1"],
              "limits": {"default_max_tokens": 64, "max_tokens": 128, "max_prompt_tokens": 10}},
        "b": {"keys": ["kb"]}}})
    tenancy = Tenancy.from_config(config)
    tenancy.check_model("a", None, frozenset({"base", "base.gguf"}))
    tenancy.check_model("a", "ad1", frozenset({"base"}))
    with pytest.raises(Exception) as err:
        tenancy.check_model("a", "ad2", frozenset({"base"}))
    assert err.value.http_status == 403 and err.value.code == "model_not_allowed"
    tenancy.check_model("b", "anything", frozenset({"base"}))
    caps = tenancy.caps("a", 2048, None)
    assert (caps.default_max_tokens, caps.max_tokens_limit) == (64, 128)
    assert tenancy.caps("a", 2048, 100).max_tokens_limit == 100
    assert (tenancy.caps("b", 2048, None).default_max_tokens, tenancy.caps(None, None, 7).max_tokens_limit) == (2048, 7)
    tenancy.check_prompt_tokens("a", 10, "prompt")
    with pytest.raises(InvalidRequestError) as err:
        tenancy.check_prompt_tokens("a", 11, "prompt")
    assert err.value.param == "prompt" and err.value.code == "prompt_tokens_limit_exceeded"


# -------------------------------------------------------------- rate limits
def test_request_burst_at_twice_the_limit_lets_exactly_the_limit_through():
    clock = Clock()
    limiter = RateLimiter({"a": TenantLimits(requests_per_min=5)}, clock)
    passed, refused = 0, []
    for _ in range(10):
        try:
            limiter.settle(limiter.admit("a"), 0)
            passed += 1
        except RateLimitError as err:
            refused.append(err)
    assert passed == 5 and len(refused) == 5
    assert all(e.http_status == 429 and e.error_type == "requests" and e.retry_after_s == 12 for e in refused)
    headers = limiter.headers("a")
    assert headers == {"x-ratelimit-limit-requests": "5", "x-ratelimit-remaining-requests": "0",
                       "x-ratelimit-reset-requests": "1m0s"}
    clock.now += 12.0                                     # one request refills every 60 / 5 s
    limiter.admit("a")
    with pytest.raises(RateLimitError):
        limiter.admit("a")
    assert limiter.headers(None) == {} and limiter.headers("unlimited") == {}


def test_tokens_reserved_then_settled_to_actual():
    clock = Clock()
    limiter = RateLimiter({"a": TenantLimits(tokens_per_min=1000)}, clock)
    first = limiter.admit("a")
    limiter.reserve_tokens(first, 600)                    # prompt + max_tokens
    second = limiter.admit("a")
    with pytest.raises(RateLimitError) as err:
        limiter.reserve_tokens(second, 600)
    assert err.value.error_type == "tokens" and err.value.retry_after_s == 12   # 200 short at 1000/60 per s
    limiter.settle(first, 150)                            # used 150 of the 600 it reserved
    assert limiter.headers("a")["x-ratelimit-remaining-tokens"] == "850"
    limiter.reserve_tokens(second, 600)
    limiter.settle(second, None)                          # never ran: everything back
    limiter.settle(second, None)                          # idempotent
    assert limiter.headers("a")["x-ratelimit-remaining-tokens"] == "850"
    with pytest.raises(InvalidRequestError) as err:       # can never pass: 400, not 429
        limiter.reserve_tokens(limiter.admit("a"), 1001)
    assert err.value.code == "tokens_per_min_exceeded"


def test_concurrency_slots_come_back_on_settle():
    limiter = RateLimiter({"a": TenantLimits(max_concurrent_requests=2)}, Clock())
    tickets = [limiter.admit("a"), limiter.admit("a")]
    with pytest.raises(RateLimitError) as err:
        limiter.admit("a")
    assert err.value.code == "concurrency_limit_exceeded"
    limiter.settle(tickets[0], 10)
    assert limiter.num_concurrent("a") == 1
    limiter.admit("a")


def test_format_reset():
    assert [format_reset(x) for x in (0.0123, 1.5, 12.0, 60.0, 361.0)] == ["12ms", "1.5s", "12s", "1m0s", "6m1s"]
