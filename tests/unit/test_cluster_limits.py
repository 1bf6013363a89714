"""Tier 1: the tenants file's rate limits enforced once for the whole fleet at the cluster
ingress (kvserve/cluster/limits.py): what two replicas' own limiters would let through
twice, the ingress's one limiter lets through once; its refusals are the single server's
(same error body, Retry-After and x-ratelimit-* headers); token reservations are settled
from the answer's usage. Hand-moved clock."""
import json

import pytest

from kvserve.cluster.limits import FleetLimits, UsageTail
from kvserve.errors import InvalidRequestError
from kvserve.server.app import error_response
from kvserve.server.rate_limit import RateLimiter, RateLimitError
from kvserve.server.tenants import TenantLimits, TenantsConfig, Tenant

CHAT = "/v1/chat/completions"
BODY = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 40}


def _fleet(clock, **limits) -> FleetLimits:
    return FleetLimits({"acme": TenantLimits(**limits)}, default_max_tokens=2048, clock=lambda: clock[0])


def _admitted(admit, attempts: int) -> int:
    count = 0
    for _ in range(attempts):
        try:
            admit()
            count += 1
        except RateLimitError:
            pass
    return count


def test_two_replicas_own_limiters_let_twice_the_limit_through_the_fleets_once():
    clock = [0.0]
    replicas = [RateLimiter({"acme": TenantLimits(requests_per_min=3)}, clock=lambda: clock[0]) for _ in range(2)]
    spread = iter(replicas * 10)                              # round robin over the two replicas
    assert _admitted(lambda: next(spread).admit("acme"), 10) == 6
    fleet = _fleet(clock, requests_per_min=3)
    assert _admitted(lambda: fleet.admit("acme", CHAT, BODY, 10), 10) == 3
    clock[0] += 20.0                                          # 3 / 60 s refill: one more after 20 s
    assert _admitted(lambda: fleet.admit("acme", CHAT, BODY, 10), 3) == 1
    assert _admitted(lambda: fleet.admit("other", CHAT, BODY, 10), 20) == 20   # not in the file: unlimited


def test_a_refusal_is_the_single_servers_429_with_its_headers():
    clock = [0.0]
    fleet = _fleet(clock, requests_per_min=2)
    fleet.admit("acme", CHAT, BODY, 10)
    fleet.admit("acme", CHAT, BODY, 10)
    with pytest.raises(RateLimitError) as refused:
        fleet.admit("acme", CHAT, BODY, 10)
    ours = fleet.refusal(refused.value, "acme")
    server = error_response(refused.value, fleet.headers("acme"))
    assert ours.status_code == server.status_code == 429
    assert json.loads(ours.body) == json.loads(server.body)
    assert json.loads(ours.body)["error"]["code"] == "rate_limit_exceeded"
    assert ours.headers["retry-after"] == server.headers["retry-after"] == "30"   # 1 request at 2/min
    assert ours.headers["x-ratelimit-limit-requests"] == "2"
    assert ours.headers["x-ratelimit-remaining-requests"] == "0"
    assert ours.headers["x-ratelimit-reset-requests"] == server.headers["x-ratelimit-reset-requests"]


def test_concurrency_is_counted_across_the_fleet_until_the_answer_ends():
    clock = [0.0]
    fleet = _fleet(clock, max_concurrent_requests=2)
    first = fleet.admit("acme", CHAT, BODY, 10)
    fleet.admit("acme", CHAT, BODY, 10)
    with pytest.raises(RateLimitError) as refused:
        fleet.admit("acme", CHAT, BODY, 10)
    assert refused.value.code == "concurrency_limit_exceeded"
    fleet.settle(first, 200, b"")
    fleet.settle(first, 200, b"")                             # settled once, however often
    fleet.admit("acme", CHAT, BODY, 10)
    with pytest.raises(RateLimitError):
        fleet.admit("acme", CHAT, BODY, 10)


def test_tokens_are_reserved_then_settled_to_the_reported_usage():
    clock = [0.0]
    fleet = _fleet(clock, tokens_per_min=100)
    remaining = lambda: int(fleet.headers("acme")["x-ratelimit-remaining-tokens"])   # noqa: E731
    ticket = fleet.admit("acme", CHAT, BODY, 10)              # 10 prompt + 40 max_tokens
    assert ticket.num_reserved_tokens == 50 and remaining() == 50
    tail = UsageTail()
    for chunk in ('data: {"choices": []}\n\n', 'data: {"usage": {"prompt_tokens": 10, "completion_tokens": 8, '
                  '"total_tokens": 18}}\n\n', "data: [DONE]\n\n"):
        tail.add(chunk.encode())
    fleet.settle(ticket, 200, tail.data)
    assert remaining() == 82
    refused = fleet.admit("acme", CHAT, BODY, 10)
    fleet.settle(refused, 429, b"")                           # the replica refused it: nothing used
    assert remaining() == 82
    unreported = fleet.admit("acme", CHAT, BODY, 10)
    fleet.settle(unreported, 200, b"data: [DONE]\n\n")        # a stream without usage: the whole reservation
    assert remaining() == 32
    with pytest.raises(RateLimitError) as short:
        fleet.admit("acme", CHAT, BODY, 10)
    assert short.value.error_type == "tokens" and short.value.retry_after_s == 11   # 18 tokens at 100/min
    with pytest.raises(InvalidRequestError):                  # more than the bucket ever holds: 400
        fleet.admit("acme", CHAT, {**BODY, "max_tokens": 500}, 10)


def test_the_token_estimate_follows_the_servers_length_rules():
    clock = [0.0]
    fleet = FleetLimits({"acme": TenantLimits(tokens_per_min=10_000, max_tokens=300)}, default_max_tokens=2048,
                        clock=lambda: clock[0])
    assert fleet.estimate_tokens("acme", CHAT, {"messages": []}, 10) == 10 + 300          # the tenant's cap
    assert fleet.estimate_tokens("other", CHAT, {"messages": []}, 10) == 10 + 2048        # the server's default
    assert fleet.estimate_tokens("acme", "/v1/completions", {"prompt": "x"}, 10) == 10 + 16   # OpenAI's 16
    assert fleet.estimate_tokens("acme", "/v1/completions", {"prompt": ["a", "b"], "max_tokens": 5, "n": 2},
                                 10) == 2 * (10 + 2 * 5)
    assert fleet.estimate_tokens("acme", "/v1/completions", {"prompt": [1, 2, 3], "max_tokens": 5}, 3) == 8


def test_forwarded_answers_carry_the_fleets_headers_not_the_replicas():
    clock = [0.0]
    fleet = _fleet(clock, requests_per_min=10)
    fleet.admit("acme", CHAT, BODY, 10)
    replica = {"content-type": "application/json", "x-ratelimit-remaining-requests": "9",
               "x-ratelimit-limit-requests": "10", "x-ratelimit-reset-requests": "6s"}
    merged = fleet.with_headers("acme", replica)
    assert merged["x-ratelimit-remaining-requests"] == "9" and merged["content-type"] == "application/json"
    fleet.admit("acme", CHAT, BODY, 10)                       # another replica's request: the fleet saw both
    assert fleet.with_headers("acme", replica)["x-ratelimit-remaining-requests"] == "8"
    assert fleet.with_headers("other", replica) == replica    # unlimited: untouched


def test_a_file_that_limits_nobody_puts_nothing_at_the_ingress():
    free = TenantsConfig({"acme": Tenant("acme", ("k",))})
    assert FleetLimits.from_config(free) is None and FleetLimits.from_config(None) is None
    limited = TenantsConfig({"acme": Tenant("acme", ("k",), limits=TenantLimits(requests_per_min=5))})
    assert FleetLimits.from_config(limited).headers("acme")["x-ratelimit-limit-requests"] == "5"
