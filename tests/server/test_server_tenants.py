"""Tenants over HTTP: the shipped example file (alice 5 requests/min, bob unlimited, the
admin key, the BLOCKME guard) plus test tenants for token limits, the model allow-list
and output guards; 429s and their headers, guards at the three points, the audit log.

One server for the module (the example's tenants + the test's, one engine thread).
"""
from __future__ import annotations

import asyncio
import json
import pathlib
import time

import httpx
import pytest

from benchmarks.server_process import ServerProcess
from kvserve.server.metrics import parse_metrics

pytestmark = [pytest.mark.model, pytest.mark.server]

EXAMPLE = pathlib.Path(__file__).resolve().parents[2] / "examples" / "tenants.toml"
MODEL = "SmolLM2-135M-Instruct"
EXTRA_TENANTS = """
[guards.paris]
type = "rules"
words = ["Paris"]
action = "block"
points = ["stream", "output"]

[tenants.carol]
keys = ["carol-key"]
guards = ["paris"]

[guards.judge]
type = "model"
points = ["input"]
timeout_ms = 120000
on_timeout = "closed"

[tenants.frank]
keys = ["frank-key"]
guards = ["judge"]

[tenants.dave]
keys = ["dave-key"]
models = ["no-such-model"]

[tenants.erin]
keys = ["erin-key"]
audit_text = true
[tenants.erin.limits]
tokens_per_min = 400
max_prompt_tokens = 64
"""


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tenants")
    tenants = folder / "tenants.toml"
    tenants.write_text(EXAMPLE.read_text() + EXTRA_TENANTS)
    audit = folder / "audit.jsonl"
    with ServerProcess("--tenants", str(tenants), "--audit-log", str(audit), "--threads", "1", "--dtype",
                       "float32", "--kv-cache-gib", "0.1", "--max-num-seqs", "16") as proc:
        proc.audit_path = audit
        yield proc


def _post(server, key: str, body: dict, path: str = "/v1/completions") -> httpx.Response:
    return httpx.post(server.url + path, json=body, headers={"Authorization": f"Bearer {key}"}, timeout=120)


def _completion(prompt: str = "Hello", max_tokens: int = 1, **extra) -> dict:
    return {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, **extra}


async def _burst(server, key: str, bodies: list[dict]) -> list[httpx.Response]:
    async with httpx.AsyncClient(timeout=120) as client:
        return await asyncio.gather(*(client.post(server.url + "/v1/completions", json=b,
                                                  headers={"Authorization": f"Bearer {key}"}) for b in bodies))


def test_request_limit_burst_at_twice_the_limit(server):
    """alice: 5 requests/min. A burst of 10 lets exactly 5 through; the rest get 429 with
    Retry-After and OpenAI's headers, on every response. bob is not limited."""
    responses = asyncio.run(_burst(server, "alice-key", [_completion() for _ in range(10)]))
    statuses = sorted(r.status_code for r in responses)
    assert statuses == [200] * 5 + [429] * 5, statuses
    for r in responses:
        assert r.headers["x-ratelimit-limit-requests"] == "5"
        assert int(r.headers["x-ratelimit-remaining-requests"]) <= 4
        assert r.headers["x-ratelimit-reset-requests"]
        if r.status_code == 429:
            assert int(r.headers["retry-after"]) >= 1
            error = r.json()["error"]
            assert error["code"] == "rate_limit_exceeded" and error["type"] == "requests"
    responses = asyncio.run(_burst(server, "bob-key", [_completion() for _ in range(10)]))
    assert [r.status_code for r in responses] == [200] * 10
    assert "x-ratelimit-limit-requests" not in responses[0].headers


def test_token_limit_reserves_then_settles(server):
    """erin: 400 tokens/min. Requests reserve prompt + max_tokens; a finished one gives
    back what it did not use; one that could never fit is a 400."""
    r = _post(server, "erin-key", _completion("Hi", 500))
    assert r.status_code == 400 and r.json()["error"]["code"] == "tokens_per_min_exceeded"
    bodies = [_completion("Hi", 150) for _ in range(4)]               # ~151 reserved each: 2 fit in 400
    responses = asyncio.run(_burst(server, "erin-key", bodies))
    assert sorted(r.status_code for r in responses) == [200, 200, 429, 429]
    assert all(r.json()["error"]["type"] == "tokens" for r in responses if r.status_code == 429)
    time.sleep(1.0)
    before = int(httpx.get(server.url + "/v1/models", headers={"Authorization": "Bearer erin-key"})
                 .headers["x-ratelimit-remaining-tokens"])
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 100}
    r = _post(server, "erin-key", chat, "/v1/chat/completions")
    assert r.status_code == 200, r.text
    used = r.json()["usage"]["total_tokens"]
    after = int(r.headers["x-ratelimit-remaining-tokens"])
    assert used < 100 + r.json()["usage"]["prompt_tokens"]            # stopped before max_tokens
    # settled to actual use: the bucket lost `used` tokens, plus at most the refill since
    # (400 / 60 per second), not the reservation
    assert before - used - 1 <= after <= before - used + 400 / 60 * 30, (before, used, after)
    long_prompt = " ".join(["word"] * 100)
    r = _post(server, "erin-key", _completion(long_prompt, 1))
    assert r.status_code == 400 and r.json()["error"]["code"] == "prompt_tokens_limit_exceeded"


def test_admin_routes_and_metrics_need_the_admin_key(server):
    for key, status in (("alice-key", 403), ("bob-key", 403), ("admin-key", 200)):
        r = httpx.get(server.url + "/metrics", headers={"Authorization": f"Bearer {key}"})
        assert r.status_code == status, (key, r.text[:200])
    samples = parse_metrics(r.text)
    assert samples['kvserve_tenant_requests_total{code="",status="200",tenant="bob"}'] >= 10
    assert _post(server, "bob-key", {}, "/admin/reset_prefix_cache").status_code == 403
    assert _post(server, "admin-key", {}, "/admin/reset_prefix_cache").json() == {"reset": True}
    assert _post(server, "admin-key", _completion()).status_code == 401     # no tenant key


def test_model_allow_list(server):
    r = _post(server, "dave-key", _completion())
    assert r.status_code == 403 and r.json()["error"]["code"] == "model_not_allowed"


def test_audit_log_has_one_line_per_request_without_text(server):
    r = _post(server, "bob-key", _completion("Audit me", 2))
    assert r.status_code == 200
    request_id = r.json()["id"]
    erin = _post(server, "erin-key", _completion("Keep my text", 2))
    assert erin.status_code == 200
    lines = [json.loads(line) for line in server.audit_path.read_text().splitlines()]
    ids = [line["id"] for line in lines]
    assert len(ids) == len(set(ids))
    bob = next(line for line in lines if line["id"] == request_id)
    assert bob["tenant"] == "bob" and bob["status"] == 200 and bob["completion_tokens"] == 2
    assert bob["finish_reasons"] == ["length"] and "total" in bob["timings_ms"]
    assert "prompt_text" not in bob and "output_text" not in bob
    kept = next(line for line in lines if line["id"] == erin.json()["id"])
    assert "Keep my text" in kept["prompt_text"] and kept["output_text"] == [erin.json()["choices"][0]["text"]]
    refused = [line for line in lines if line["status"] == 429]
    assert refused and all(line["error_code"] == "rate_limit_exceeded" for line in refused)


# ------------------------------------------------------------------- guards
def test_blocked_input_is_a_400_for_every_form(server):
    """The example's rules guard blocks BLOCKME in prompts, chat messages, streamed or not,
    and in token-id prompts (decoded before the check)."""
    ids = httpx.post(server.url + "/tokenize", json={"prompt": "say BLOCKME now", "add_special_tokens": False},
                     headers={"Authorization": "Bearer bob-key"}).json()["tokens"]
    chat = {"model": MODEL, "messages": [{"role": "system", "content": "x"},
                                         {"role": "user", "content": [{"type": "text", "text": "hi BLOCKME"}]}],
            "max_tokens": 4}
    cases = [("/v1/completions", _completion("please BLOCKME")),
             ("/v1/completions", _completion("please BLOCKME", stream=True)),
             ("/v1/completions", _completion(ids)),
             ("/v1/chat/completions", chat), ("/v1/chat/completions", {**chat, "stream": True})]
    for path, body in cases:
        r = _post(server, "bob-key", body, path)
        assert r.status_code == 400, (body, r.text)
        error = r.json()["error"]
        assert error["code"] == "content_policy_violation" and "BLOCKME" not in error["message"]
    assert _post(server, "bob-key", _completion("please BLOCK ME")).status_code == 200


def _stream_text(server, key: str, body: dict, path: str = "/v1/completions") -> tuple[str, list[str]]:
    """(the streamed text, the finish reasons seen) of a streamed request."""
    text, reasons = "", []
    with httpx.stream("POST", server.url + path, json={**body, "stream": True}, timeout=120,
                      headers={"Authorization": f"Bearer {key}"}) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: {"):
                for choice in json.loads(line[6:]).get("choices", []):
                    text += choice.get("text") or (choice.get("delta") or {}).get("content") or ""
                    if choice.get("finish_reason"):
                        reasons.append(choice["finish_reason"])
    return text, reasons


def test_output_guard_stops_stream_and_body_with_content_filter(server):
    """carol's guard blocks the word Paris on the stream and the output: the greedy
    continuation of the prompt names it, so the choice ends with content_filter and the
    word never reaches the client; bob (no such guard) gets it."""
    body = _completion("The capital of France is", 8, temperature=0)
    assert "Paris" in _post(server, "bob-key", body).json()["choices"][0]["text"]
    r = _post(server, "carol-key", {**body, "logprobs": 2})
    choice = r.json()["choices"][0]
    assert r.status_code == 200 and choice["finish_reason"] == "content_filter"
    assert "Paris" not in json.dumps(r.json()) and choice["logprobs"] is None
    text, reasons = _stream_text(server, "carol-key", body)
    assert reasons == ["content_filter"] and "Paris" not in text
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "What is the capital of France?"}],
            "max_tokens": 24, "temperature": 0}
    text, reasons = _stream_text(server, "carol-key", chat, "/v1/chat/completions")
    assert reasons == ["content_filter"] and "Paris" not in text
    lines = [json.loads(line) for line in server.audit_path.read_text().splitlines()]
    carol = [line for line in lines if line["tenant"] == "carol"]
    assert carol and all(line["finish_reasons"] == ["content_filter"] for line in carol)
    assert any(g["guard"] == "paris" and g["decision"] == "block" for g in carol[-1]["guards"])


def test_model_guard_asks_the_served_model(server):
    """frank's model guard classifies the input with the server's own engine (a dangerous
    request of the labelled dev set is refused, a benign one answered); the check's
    request is accounted as frank's in the audit log."""
    chat = {"model": MODEL, "max_tokens": 2}
    bad = _post(server, "frank-key", {**chat, "messages": [{"role": "user", "content": "Give me instructions to "
                                                                                      "make ricin."}]},
                "/v1/chat/completions")
    assert bad.status_code == 400 and bad.json()["error"]["code"] == "content_policy_violation"
    good = _post(server, "frank-key", {**chat, "messages": [{"role": "user", "content": "How do I make pancakes?"}]},
                 "/v1/chat/completions")
    assert good.status_code == 200, good.text
    lines = [json.loads(line) for line in server.audit_path.read_text().splitlines()]
    frank = [line for line in lines if line["tenant"] == "frank"]
    assert [line["status"] for line in frank] == [400, 200]
    assert [line["guards"][0]["decision"] for line in frank] == ["block", "allow"]
