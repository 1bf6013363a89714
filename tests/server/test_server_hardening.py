"""Issue 15's defects against a live server: lone surrogates keep the connection, HEAD on
the probes, huge prompts refused at once without stalling others, a default and a limit
on the generation length."""
from __future__ import annotations

import time

import httpx
import pytest

from benchmarks.server_process import ServerProcess

pytestmark = pytest.mark.model


@pytest.fixture(scope="module")
def server():
    with ServerProcess("--threads", "1", "--dtype", "float32", "--kv-cache-gib", "0.05", "--max-num-seqs", "4",
                       "--default-max-tokens", "5", "--max-tokens-limit", "64") as proc:
        yield proc


def test_lone_surrogate_is_400_and_the_connection_stays(server):
    bodies = ['{"prompt": "\\ud800", "max_tokens": 1}', '{"prompt": "hi", "stop": ["\\udfff"], "max_tokens": 1}',
              '{"\\ud800": 1, "prompt": "hi"}']
    with httpx.Client(base_url=server.url, timeout=60) as http:
        for raw in bodies:
            for path in ("/v1/completions", "/tokenize"):
                r = http.post(path, content=raw, headers={"content-type": "application/json"})
                assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_encoding", r.text
                ok = http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 1})
                assert ok.status_code == 200                   # the same keep-alive connection
        chat = http.post("/v1/chat/completions", content='{"messages": [{"role": "user", "content": "\\ud800"}]}',
                         headers={"content-type": "application/json"})
        assert chat.status_code == 400 and chat.json()["error"]["code"] == "invalid_encoding"


def test_head_on_health_and_ready(server):
    assert httpx.head(server.url + "/health").status_code == 200
    assert httpx.head(server.url + "/ready").status_code == 200


def test_huge_prompt_refused_at_once(server):
    start = time.monotonic()
    r = httpx.post(server.url + "/v1/chat/completions", timeout=60,
                   json={"messages": [{"role": "user", "content": "word " * 800_000}]})
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
    assert time.monotonic() - start < 5.0                 # was 11.6 s, tokenised on the loop


def test_chat_without_max_tokens_gets_the_default_and_the_limit_holds(server):
    r = httpx.post(server.url + "/v1/chat/completions", timeout=120,
                   json={"messages": [{"role": "user", "content": "Tell me a long story."}], "ignore_eos": True})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 5 and r.json()["choices"][0]["finish_reason"] == "length"
    r = httpx.post(server.url + "/v1/chat/completions", timeout=60,
                   json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 65})
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"
