"""Issue 18's conformance gaps, probed with the official OpenAI SDK as a new user would,
against a real ``kvserve serve`` (API keys for two tenants and an admin key).

/v1/models/{id}; unknown roles and ``developer``; chat logprobs without the end-of-turn
token (whole and streamed); the newer SDK fields, with ``prompt_cache_key`` unable to
cross tenants in the prefix cache; emoji byte tokens in completions logprobs;
/tokenizer_info and /openapi.json behind the keys.
"""
from __future__ import annotations

import re

import httpx
import openai
import pytest

from benchmarks.server_process import ServerProcess

pytestmark = pytest.mark.model

ALICE, BOB, ADMIN = "conf-alice-key", "conf-bob-key", "conf-admin-key"
MODEL = "SmolLM2-135M-Instruct"
QUESTION = [{"role": "user", "content": "What is 2+2? Answer with one number."}]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    keys = tmp_path_factory.mktemp("keys") / "keys.txt"
    keys.write_text(f"{ALICE} alice\n{BOB} bob\n")
    with ServerProcess("--api-keys-file", str(keys), "--admin-api-key", ADMIN, "--threads", "1",
                       "--dtype", "float32", "--kv-cache-gib", "0.1", "--max-num-seqs", "8") as proc:
        yield proc


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.base_url, api_key=ALICE, max_retries=0, timeout=120)


def _get(server, path: str, key: str | None = ALICE) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.get(server.url + path, headers=headers, timeout=30)


def _join(tokens: list[str]) -> str:
    """Text rebuilt from logprob tokens (``bytes:\\xNN`` spellings are raw bytes)."""
    out = b""
    for token in tokens:
        if token.startswith("bytes:"):
            out += bytes(int(h, 16) for h in re.findall(r"\\x([0-9a-f]{2})", token))
        else:
            out += token.encode("utf-8")
    return out.decode("utf-8")


def test_retrieve_model(server, client):
    assert client.models.retrieve(MODEL).id == MODEL
    with pytest.raises(openai.NotFoundError) as info:
        client.models.retrieve("no-such-model")
    assert info.value.body["code"] == "model_not_found"
    assert _get(server, f"/v1/models/{MODEL}", key=None).status_code == 401
    assert _get(server, f"/v1/models/{MODEL}", key=ADMIN).status_code == 401


def test_unknown_role_and_developer_as_system(server, client):
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=MODEL, max_tokens=2,
                                       messages=[{"role": "user", "content": "a"}, {"role": "robot", "content": "b"}])
    assert info.value.body["param"] == "messages[1].role"

    def tokens(role: str) -> list[int]:
        body = {"messages": [{"role": role, "content": "Answer in French."}, {"role": "user", "content": "Hi"}]}
        r = httpx.post(server.url + "/tokenize", json=body, headers={"Authorization": f"Bearer {ALICE}"})
        assert r.status_code == 200, r.text
        return r.json()["tokens"]
    assert tokens("developer") == tokens("system")
    reply = client.chat.completions.create(model=MODEL, max_tokens=4, temperature=0,
                                           messages=[{"role": "developer", "content": "Be brief."}, *QUESTION])
    assert reply.choices[0].message.content


def test_chat_logprobs_agree_with_content(client):
    kw = dict(model=MODEL, messages=QUESTION, max_tokens=32, temperature=0, logprobs=True, top_logprobs=2)
    whole = client.chat.completions.create(**kw)
    choice = whole.choices[0]
    assert choice.finish_reason == "stop"                 # it ended on the end-of-turn token
    tokens = [c.token for c in choice.logprobs.content]
    assert _join(tokens) == choice.message.content
    assert len(tokens) == whole.usage.completion_tokens - 1
    streamed = [c for chunk in client.chat.completions.create(**kw, stream=True) for ch in chunk.choices
                if ch.logprobs and ch.logprobs.content for c in ch.logprobs.content]
    assert [c.token for c in streamed] == tokens
    assert [c.logprob for c in streamed] == pytest.approx([c.logprob for c in choice.logprobs.content], abs=1e-4)


def test_new_sdk_fields(server, client):
    reply = client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=2, prompt_cache_key="conv-1",
                                           safety_identifier="user-1", store=False, metadata={"team": "a"},
                                           parallel_tool_calls=False)
    assert reply.choices[0].message.content is not None
    for field, value in [("store", True), ("metadata", {"k": 1}), ("prompt_cache_key", 7)]:
        with pytest.raises(openai.BadRequestError) as info:
            client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=2, extra_body={field: value})
        assert info.value.body["param"] == field


def test_prompt_cache_key_keeps_tenants_apart(server):
    prompt = "The quick brown fox jumps over the lazy dog. " * 12 + "Tenant isolation check."

    def cached(key: str) -> int:
        body = {"model": MODEL, "prompt": prompt, "max_tokens": 1, "prompt_cache_key": "shared-session"}
        r = httpx.post(server.url + "/v1/completions", json=body, headers={"Authorization": f"Bearer {key}"},
                       timeout=120)
        assert r.status_code == 200, r.text
        return r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
    cached(ALICE)
    assert cached(BOB) == 0                               # same key, other tenant: nothing shared
    assert cached(ALICE) > 0                              # same tenant: the prefix is cached


def test_completion_logprobs_of_emoji_stay_distinct(client):
    prompt = "🍕🍔🍟 are my favourite"
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=1, temperature=0, echo=True, logprobs=5)
    lp = r.choices[0].logprobs
    echoed = lp.tokens[:len(lp.tokens) - 1]
    assert _join(echoed) == prompt
    assert any(t.startswith("bytes:") for t in echoed) and not any("\ufffd" in t for t in lp.tokens)
    assert all(len(top) == 5 for top in lp.top_logprobs[1:])     # no two candidates share a key


def test_tokenizer_info(server):
    assert _get(server, "/tokenizer_info", key=None).status_code == 401
    info = _get(server, "/tokenizer_info").json()
    assert info["eos_token"] == "<|im_end|>" and info["eos_token_id"] in info["eos_token_ids"]
    assert "im_start" in info["chat_template"] and info["model_max_length"] > 0


def test_openapi_document(server):
    assert _get(server, "/openapi.json", key=None).status_code == 401
    doc = _get(server, "/openapi.json").json()
    assert doc["openapi"].startswith("3.1")
    assert {"/v1/completions", "/v1/chat/completions", "/v1/models/{model_id}", "/tokenize", "/detokenize",
            "/tokenizer_info"} <= set(doc["paths"])
    chat = doc["paths"]["/v1/chat/completions"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    assert chat["properties"]["prompt_cache_key"]["anyOf"][0] == {"type": "string", "maxLength": 256}
    assert chat["properties"]["messages"]["items"]["properties"]["role"]["enum"][:2] == ["system", "developer"]
    assert doc["paths"]["/health"]["get"]["security"] == []
