"""The OpenAI-compatible API end to end: real model, real sockets, the official SDK.

One server for the module (API key on, small KV budget, short outputs).
"""
from __future__ import annotations

import asyncio
import json

import httpx
import openai
import pytest

from benchmarks.server_process import ServerProcess
from tests.support.prompt_set import CHAT_QUESTIONS, RAW_TEXTS

pytestmark = pytest.mark.model

API_KEY = "test-key-123"            # tenant "alice"
OTHER_KEY = "other-key-456"         # tenant "bob"
MODEL = "SmolLM2-135M-Instruct"
EXTRA_TEXTS = [
    "こんにちは、今日は", "🍕🍔🍟 are my favourite foods because", "中文测试：请写一首诗", "Emoji story: 🐉🔥🏰",
    "안녕하세요, 제 이름은", "Ünïcödé façade naïve café", "Привет! Как дела?", "数学：1+1=",
    "😀😃😄😁 The end.", "Write 5 emoji: ", "日本の首都は", "The symbol for pi is π and for sum is",
    "Tab\tseparated\tvalues:", "JSON: {\"key\": \"", "Repeat after me: ñ ß ø å", "Math: ∑ ∫ √ ∞",
    "🙂 + 🙂 =", "Rust: fn main() {", "Haiku in Chinese about rain:", "Say 'hello' in Thai: สวัสดี",
]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    keys = tmp_path_factory.mktemp("keys") / "keys.txt"
    keys.write_text(f"{API_KEY} alice\n{OTHER_KEY} bob\n")
    with ServerProcess("--api-keys-file", str(keys), "--threads", "1", "--dtype", "float32", "--kv-cache-gib", "0.1",
                       "--max-num-seqs", "32") as proc:
        yield proc


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.base_url, api_key=API_KEY, max_retries=0, timeout=300)


@pytest.fixture(scope="module")
def aclient(server):
    """A factory: each asyncio.run needs its own async client (its pool is bound to the loop)."""
    return lambda: openai.AsyncOpenAI(base_url=server.base_url, api_key=API_KEY, max_retries=0, timeout=300)


def _run(coro):
    return asyncio.run(coro)


async def _gather_limited(coros, limit: int = 16):
    gate = asyncio.Semaphore(limit)

    async def one(c):
        async with gate:
            return await c
    return await asyncio.gather(*(one(c) for c in coros))


# ------------------------------------------------------------- basics
def test_models_health_ready_and_tokenize(server, client):
    assert [m.id for m in client.models.list().data] == [MODEL]
    assert httpx.get(server.url + "/health").status_code == 200         # no key needed
    assert httpx.get(server.url + "/ready").status_code == 200
    headers = {"Authorization": f"Bearer {API_KEY}"}
    tokens = httpx.post(server.url + "/tokenize", json={"prompt": "Hello world"}, headers=headers).json()
    assert tokens["count"] == len(tokens["tokens"]) > 0
    text = httpx.post(server.url + "/detokenize", json={"tokens": tokens["tokens"]}, headers=headers).json()
    assert text["prompt"] == "Hello world"
    chat = httpx.post(server.url + "/tokenize", json={"messages": [{"role": "user", "content": "hi"}]},
                      headers=headers).json()
    assert chat["count"] > tokens["count"]


async def _complete(aclient, kind: str, prompt: str, stream: bool, **kw):
    """(text, finish_reason, usage) of one request, streamed or not."""
    if kind == "chat":
        call = aclient.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": prompt}],
                                               stream=stream, **kw)
    else:
        call = aclient.completions.create(model=MODEL, prompt=prompt, stream=stream, **kw)
    if not stream:
        r = await call
        c = r.choices[0]
        return (c.message.content if kind == "chat" else c.text), c.finish_reason, r.usage.completion_tokens
    text, finish, usage = "", None, None
    async for chunk in await call:
        if chunk.usage is not None:
            usage = chunk.usage.completion_tokens
        for c in chunk.choices:
            text += (c.delta.content or "") if kind == "chat" else c.text
            finish = c.finish_reason or finish
    return text, finish, usage


def test_stream_equals_non_stream_over_many_prompts(aclient):
    prompts = CHAT_QUESTIONS + RAW_TEXTS + EXTRA_TEXTS + [q[:20] for q in CHAT_QUESTIONS]
    assert len(prompts) >= 50
    cases = [("chat" if i % 2 else "completions", p, i) for i, p in enumerate(prompts)]
    kw = dict(max_tokens=12, temperature=0.8, seed=1234)

    async def both():
        c = aclient()
        coros = []
        for kind, prompt, i in cases:
            coros.append(_complete(c, kind, prompt, False, **{**kw, "seed": i}))
            coros.append(_complete(c, kind, prompt, True, stream_options={"include_usage": True},
                                   **{**kw, "seed": i}))
        return await _gather_limited(coros)
    results = _run(both())
    for n, (kind, prompt, _) in enumerate(cases):
        whole, streamed = results[2 * n], results[2 * n + 1]
        assert streamed == whole, (kind, prompt)
    assert any(ord(ch) > 0x2E80 for text, _, _ in results for ch in text)      # some CJK/emoji came out


def test_stop_strings_spanning_tokens(aclient, client):
    """A stop string made of the end of one token and the start of the next cuts the text there,
    identically streamed and not."""
    checked = 0
    for prompt in RAW_TEXTS[:8]:
        r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=16, temperature=0, logprobs=0)
        tokens = r.choices[0].logprobs.tokens
        full = r.choices[0].text
        spans = [(k, tokens[k][-2:] + tokens[k + 1][:2]) for k in range(2, len(tokens) - 1)
                 if len(tokens[k]) >= 2 and len(tokens[k + 1]) >= 2]
        if not spans:
            continue
        k, stop = spans[0]
        expected = full[:full.find(stop)]

        async def both():
            c = aclient()
            return await asyncio.gather(
                _complete(c, "completions", prompt, False, max_tokens=16, temperature=0, stop=[stop]),
                _complete(c, "completions", prompt, True, max_tokens=16, temperature=0, stop=[stop]))
        whole, streamed = _run(both())
        assert whole[:2] == streamed[:2]
        assert whole[0] == expected and whole[1] == "stop", (prompt, stop)
        checked += 1
    assert checked >= 4


def test_greedy_http_equals_offline_engine(client, llm):
    from kvserve.sampling.params import SamplingParams
    prompts = RAW_TEXTS[:4] + ["请用一句话介绍你自己。"]
    offline = llm.generate([{"prompt": p} for p in prompts], SamplingParams(max_tokens=20, temperature=0))
    for prompt, out in zip(prompts, offline):
        r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=20, temperature=0)
        assert r.choices[0].text == out.outputs[0].text
        assert r.usage.completion_tokens == len(out.outputs[0].token_ids)
        assert r.usage.prompt_tokens == len(out.prompt_token_ids)
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    chat = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=20, temperature=0)
    assert chat.choices[0].message.content == llm.chat(messages, SamplingParams(max_tokens=20, temperature=0))[0] \
        .outputs[0].text


def test_logprobs_echo_n_and_usage(client):
    r = client.completions.create(model=MODEL, prompt=["Hello", "World"], max_tokens=3, n=2, temperature=0.7,
                                  seed=5, logprobs=2, user="someone")
    assert sorted(c.index for c in r.choices) == [0, 1, 2, 3]
    assert r.usage.completion_tokens == sum(len(c.logprobs.tokens) for c in r.choices)
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    for c in r.choices:
        assert len(c.logprobs.token_logprobs) == len(c.logprobs.tokens) == len(c.logprobs.top_logprobs)
        assert all(len(top) <= 2 for top in c.logprobs.top_logprobs)
    e = client.completions.create(model=MODEL, prompt="Echo me", max_tokens=2, temperature=0, echo=True)
    assert e.choices[0].text.startswith("Echo me")
    ids = client.completions.create(model=MODEL, prompt=[[504, 3458], [504]], max_tokens=2, temperature=0)
    assert len(ids.choices) == 2 and ids.usage.prompt_tokens == 3
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                          max_completion_tokens=3, logprobs=True, top_logprobs=3, temperature=0,
                                          top_p=0.9, presence_penalty=0.1, frequency_penalty=0.1,
                                          extra_body={"top_k": 20, "min_p": 0.05, "repetition_penalty": 1.1})
    content = chat.choices[0].logprobs.content
    assert len(content) == chat.usage.completion_tokens == 3
    assert all(len(t.top_logprobs) == 3 and t.bytes for t in content)
    assert content[0].top_logprobs[0].logprob >= content[0].top_logprobs[1].logprob


def test_echo_with_logprobs(client):
    """echo + logprobs: the prompt's tokens lead the logprobs (the first with null), whole
    and streamed alike, and the prompt tokens' logprobs are the model's."""
    prompt = "The capital of France is Paris. The capital of Italy is"
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=3, temperature=0, echo=True, logprobs=2)
    lp = r.choices[0].logprobs
    num_prompt = r.usage.prompt_tokens
    assert len(lp.tokens) == num_prompt + 3 == len(lp.token_logprobs) == len(lp.top_logprobs)
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert all(v is not None and v <= 0 for v in lp.token_logprobs[1:])
    assert "".join(lp.tokens[:num_prompt]) == prompt
    assert lp.text_offset[:2] == [0, len(lp.tokens[0])] and lp.text_offset[num_prompt] == len(prompt)
    # " Rome" after "The capital of Italy is" is likely: the prompt's own logprobs are real
    assert max(lp.token_logprobs[1:num_prompt]) > -1.0
    stream = client.completions.create(model=MODEL, prompt=prompt, max_tokens=3, temperature=0, echo=True,
                                       logprobs=2, stream=True)
    tokens, values = [], []
    for chunk in stream:
        if chunk.choices and chunk.choices[0].logprobs is not None:
            tokens += chunk.choices[0].logprobs.tokens
            values += chunk.choices[0].logprobs.token_logprobs
    assert tokens == lp.tokens
    assert values[0] is None and values[1:] == pytest.approx(lp.token_logprobs[1:], abs=1e-4)


def _token_id(server, text: str) -> int:
    """The id of ``text`` when it is exactly one token (via /tokenize)."""
    r = httpx.post(server.url + "/tokenize", json={"prompt": text, "add_special_tokens": False}, timeout=60,
                   headers={"Authorization": f"Bearer {API_KEY}"}).json()
    assert r["count"] == 1, r
    return r["tokens"][0]


def test_logit_bias_forces_and_bans_tokens(server, client, aclient):
    cat = _token_id(server, " cat")
    for kw in (dict(temperature=0), dict(temperature=1.0, seed=3), dict(temperature=0.8, top_p=0.9)):
        r = client.completions.create(model=MODEL, prompt="My favourite animal is", max_tokens=3,
                                      logit_bias={str(cat): 100}, **kw)
        assert r.choices[0].text == " cat cat cat" and r.choices[0].finish_reason == "length", kw
        assert r.usage.completion_tokens == 3
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Name a dog."}],
                                          max_tokens=3, temperature=0, logit_bias={cat: 100})
    assert chat.choices[0].message.content == " cat cat cat"
    streamed = _run(_complete(aclient(), "chat", "Name a dog.", True, max_tokens=3, temperature=0,
                              logit_bias={cat: 100}, stream_options={"include_usage": True}))
    assert streamed == (" cat cat cat", "length", 3)
    # -100 bans the greedy choice: the runner-up comes instead, with its raw logprob.
    prompt = "The capital of France is"
    base = client.completions.create(model=MODEL, prompt=prompt, max_tokens=1, temperature=0, logprobs=2)
    (first, second) = base.choices[0].logprobs.top_logprobs[0].items()
    banned = client.completions.create(model=MODEL, prompt=prompt, max_tokens=1, temperature=0, logprobs=2,
                                       logit_bias={str(_token_id(server, first[0])): -100})
    assert banned.choices[0].text == second[0] != base.choices[0].text
    assert banned.choices[0].logprobs.token_logprobs[0] == pytest.approx(second[1], abs=1e-4)


def test_tenants_do_not_share_the_prefix_cache(server):
    """The key's tenant reaches the engine: a prompt alice sent is cached for alice, not for bob."""
    prompt = "Tenant isolation check. " * 20                  # > 100 tokens: several full blocks

    def cached(key: str) -> int:
        r = httpx.post(server.url + "/v1/completions", headers={"Authorization": f"Bearer {key}"}, timeout=60,
                       json={"model": MODEL, "prompt": prompt, "max_tokens": 1})
        assert r.status_code == 200, r.text
        return r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
    cached(API_KEY)
    assert cached(API_KEY) > 0, "alice's repeat missed the prefix cache (is it on in this server?)"
    assert cached(OTHER_KEY) == 0


# ------------------------------------------------------------------ errors
def _post(server, path: str, body, headers=None, key: str | None = API_KEY, raw: bytes | None = None):
    hdrs = {"Content-Type": "application/json"}
    if key:
        hdrs["Authorization"] = f"Bearer {key}"
    hdrs.update(headers or {})
    content = raw if raw is not None else __import__("json").dumps(body).encode()
    return httpx.post(server.url + path, content=content, headers=hdrs, timeout=120)


def _assert_error(response, status: int, code: str, param: str | None = "any"):
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    assert body["error"]["code"] == code and isinstance(body["error"]["code"], str)
    assert "Traceback" not in response.text
    if param != "any":
        assert body["error"]["param"] == param


def test_error_cases(server):
    ok = {"model": MODEL, "prompt": "hi", "max_tokens": 2}
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    _assert_error(_post(server, "/v1/completions", None, raw=b'{"prompt": "hi"'), 400, "invalid_json")
    _assert_error(_post(server, "/v1/completions", None, raw=b'{"prompt": "\xff\xfe"}'), 400, "invalid_encoding")
    _assert_error(_post(server, "/v1/completions", {**ok, "temperature": -1}), 400, "invalid_parameter",
                  "temperature")
    _assert_error(_post(server, "/v1/completions", {**ok, "prompt": "word " * 9000}), 400,
                  "context_length_exceeded", "prompt")
    _assert_error(_post(server, "/v1/completions", {**ok, "max_tokens": 8192}), 400,
                  "context_length_exceeded", "max_tokens")
    _assert_error(_post(server, "/v1/completions", {**ok, "max_tokens": 8000}), 400,     # beyond the KV cache
                  "context_length_exceeded", "max_tokens")
    _assert_error(_post(server, "/v1/chat/completions", {**chat, "max_tokens": None,
                                                         "max_completion_tokens": 9000}), 400,
                  "context_length_exceeded", "max_completion_tokens")
    _assert_error(_post(server, "/v1/completions", {**ok, "n": 17}), 400, "invalid_parameter", "n")
    _assert_error(_post(server, "/v1/completions", {**ok, "stop": [str(i) for i in range(17)]}), 400,
                  "invalid_parameter", "stop")
    _assert_error(_post(server, "/v1/chat/completions", {**chat, "logprobs": True, "top_logprobs": 21}), 400,
                  "invalid_parameter", "top_logprobs")
    for bias in ({"abc": 1}, {"5": 101}, {"5": "1"}, {"-5": 1}, [5], {str(i): 1 for i in range(301)},
                 {"49152": 1}, {"999999999": 1}):                        # the last two: beyond the vocabulary
        for path, body in (("/v1/completions", ok), ("/v1/chat/completions", chat)):
            for stream in (False, True):
                _assert_error(_post(server, path, {**body, "logit_bias": bias, "stream": stream}), 400,
                              "invalid_parameter", "logit_bias")
    assert _post(server, "/v1/completions", {**ok, "logit_bias": {"5": 1, "49151": -100}}).status_code == 200
    _assert_error(_post(server, "/v1/completions", {**ok, "wat": 1}), 400, "unknown_parameter", "wat")
    _assert_error(_post(server, "/v1/completions", {**ok, "prompt": [10**9]}), 400, "invalid_parameter",
                  "prompt")
    _assert_error(_post(server, "/v1/completions", ok, key=None), 401, "invalid_api_key")
    _assert_error(_post(server, "/v1/completions", ok, key="wrong"), 401, "invalid_api_key")
    _assert_error(httpx.get(server.url + "/metrics"), 401, "invalid_api_key")
    _assert_error(_post(server, "/v1/completions", {**ok, "model": "gpt-9"}), 404, "model_not_found", "model")
    _assert_error(_post(server, "/v1/completions", {**ok, "prompt": "x" * (5 * 2**20)}), 413,
                  "request_too_large")
    _assert_error(_post(server, "/v1/completions", ok, headers={"Content-Type": "text/plain"}), 415,
                  "unsupported_media_type")
    _assert_error(_post(server, "/v1/nothing", ok), 404, "not_found")
    _assert_error(httpx.get(server.url + "/v1/completions", headers={"Authorization": f"Bearer {API_KEY}"}),
                  405, "method_not_allowed")
    assert _post(server, "/v1/completions", ok).status_code == 200


def test_midstream_error_ends_with_error_event_then_done(server):
    """A request whose deadline passes mid-stream gets an error event, then [DONE]."""
    body = {"model": MODEL, "prompt": "Count: 1, 2, 3,", "max_tokens": 400, "ignore_eos": True, "stream": True,
            "deadline_s": 1.0}
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=60,
                      headers={"Authorization": f"Bearer {API_KEY}"}) as r:
        assert r.status_code == 200
        lines = [line for line in r.iter_lines() if line.startswith("data:")]
    assert lines[-1] == "data: [DONE]"
    assert '"code":"deadline_exceeded"' in lines[-2]
    assert len(lines) > 3                               # some tokens came before the deadline


def _fuzz_bodies(n: int, seed: int = 0) -> list[bytes]:
    import json
    import random
    rng = random.Random(seed)
    weird = [None, True, False, 0, -1, 1, 2**63, -(2**63) - 1, 10**30, 1e308, -1e308, 0.5, 3.0, "", "x",
             "🤖" * 3, [], [1], [[1]], {}, {"a": 1}, [None], "NaN", -0.0, 2**31, [2**70], {"role": "user"},
             [{"role": "user", "content": 5}], [{"role": "user", "content": "hi"}], [{"content": "x"}], "\x00"]
    fields = ["model", "prompt", "messages", "max_tokens", "max_completion_tokens", "temperature", "top_p",
              "top_k", "min_p", "n", "stop", "seed", "logprobs", "top_logprobs", "echo", "stream",
              "stream_options", "presence_penalty", "frequency_penalty", "repetition_penalty", "logit_bias",
              "user", "best_of", "suffix", "tools", "response_format", "min_tokens", "ignore_eos", "unknown"]
    bodies = []
    for i in range(n):
        chat = i % 2 == 0
        base = {"model": MODEL, "max_tokens": 2}
        base.update({"messages": [{"role": "user", "content": "hi"}]} if chat else {"prompt": "hi"})
        for _ in range(rng.randint(1, 3)):
            name = rng.choice(fields)
            value = rng.choice(weird)
            if name in ("max_tokens", "max_completion_tokens") and (value is None or (
                    isinstance(value, (int, float)) and not isinstance(value, bool) and 0 < value < 64)):
                value = 2                                  # keep generations short
            base[name] = value
        text = json.dumps(base, allow_nan=True)
        if rng.random() < 0.1:                             # deep nesting, up to far past any parser limit
            depth = rng.choice([10, 100, 1000, 20_000])
            text = text[:-1] + ', "user": ' + "[" * depth + "1" + "]" * depth + "}"
        mode = rng.random()
        if mode < 0.1:
            text = text[:rng.randint(0, len(text))]       # truncated JSON
        elif mode < 0.15:
            text = text.replace("2", "NaN", 1)
        raw = text.encode("utf-8", "surrogatepass")
        if rng.random() < 0.08:
            at = rng.randint(0, len(raw))
            raw = raw[:at] + bytes([rng.choice([0xff, 0xc3, 0xe2, 0x80])]) + raw[at:]   # invalid UTF-8
        bodies.append(raw)
    return bodies


def test_fuzz_bodies_never_5xx(server):
    bodies = _fuzz_bodies(1000)
    statuses = {}
    headers = {"Authorization": f"Bearer {API_KEY}", "Content-Type": "application/json"}

    async def fire():
        async with httpx.AsyncClient(timeout=120, limits=httpx.Limits(max_connections=8)) as c:
            gate = asyncio.Semaphore(8)

            async def one(i, raw):
                path = "/v1/chat/completions" if i % 2 == 0 else "/v1/completions"
                async with gate:
                    r = await c.post(server.url + path, content=raw, headers=headers)
                    await r.aread()
                assert r.status_code < 500, (raw[:300], r.status_code, r.text[:300])
                if r.status_code != 200:
                    assert set(r.json()["error"]) == {"message", "type", "param", "code"}
                statuses[r.status_code] = statuses.get(r.status_code, 0) + 1
            await asyncio.gather(*(one(i, raw) for i, raw in enumerate(bodies)))
    _run(fire())
    assert sum(statuses.values()) == 1000 and statuses.get(400, 0) > 300 and statuses.get(200, 0) > 10
    assert httpx.get(server.url + "/ready").status_code == 200
    r = _post(server, "/v1/completions", {"model": MODEL, "prompt": "The capital of France is", "max_tokens": 3,
                                          "temperature": 0, "ignore_eos": True})
    assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] == "length"


def test_fuzz_raw_headers_and_requests_never_5xx(server):
    """9,000 raw requests (with the 1,000 bodies above: 10,000) with fuzzed request lines,
    headers (auth variants, header injection, huge and many headers, bad Content-Length,
    CL + chunked, HTTP/2 preface, garbage) and bodies, sent over plain sockets: no 5xx,
    every error in the documented JSON shape, the server ready afterwards."""
    import json
    import random
    import urllib.parse

    from tests.support.http_fuzz import fuzz_case, send_all
    rng = random.Random(7)
    cases = [fuzz_case(rng, API_KEY) for _ in range(9000)]
    url = urllib.parse.urlsplit(server.url)
    results = _run(send_all(url.hostname, url.port, cases))
    statuses: dict[int, int] = {}
    for (raw, _label), (status, body, label) in zip(cases, results):
        statuses[status] = statuses.get(status, 0) + 1
        huge = b"X-Huge" in raw or b"X-Many" in raw
        assert status != 0 or huge, (label, raw[:200])            # only a refused huge head may be cut off
        assert status < 500, (label, raw[:300], status, body[:300])
        if status >= 400 and body and not raw.startswith(b"HEAD"):
            assert set(json.loads(body)["error"]) == {"message", "type", "param", "code"}, (label, body[:300])
    print("statuses:", dict(sorted(statuses.items())))
    assert statuses.get(200, 0) > 500 and statuses.get(401, 0) > 500 and statuses.get(400, 0) > 200
    assert httpx.get(server.url + "/ready").status_code == 200
    r = _post(server, "/v1/completions", {"model": MODEL, "prompt": "The capital of France is", "max_tokens": 3,
                                          "temperature": 0, "ignore_eos": True})
    assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] == "length"


# ------------------------------------------------------------ token ids
def _streamed_ids(server, path: str, body: dict) -> tuple[dict[int, list[int]], list, list]:
    """(each choice's streamed token_ids joined, the prompt_token_ids sent, every chunk) of a stream."""
    ids: dict[int, list[int]] = {}
    prompts, chunks = [], []
    with httpx.stream("POST", server.url + path, json={**body, "stream": True}, timeout=300,
                      headers={"Authorization": f"Bearer {API_KEY}"}) as r:
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            chunks.append(chunk)
            for choice in chunk["choices"]:
                ids.setdefault(choice["index"], []).extend(choice.get("token_ids", []))
                prompts += [choice["prompt_token_ids"]] if "prompt_token_ids" in choice else []
            prompts += [chunk["prompt_token_ids"]] if "prompt_token_ids" in chunk else []
    return ids, prompts, chunks


def test_return_token_ids_whole_and_streamed(server):
    """``return_token_ids``: each choice's ids decode to its text and count as its completion
    tokens; the prompts' ids are the tokenizer's; streamed, the chunks' ids join to the whole
    body's and the prompt's ids come once per choice; without the flag no ids are sent."""
    texts = ["Write 5 emoji: ", "日本の首都は"]               # multi-byte characters: text held back
    body = {"model": MODEL, "prompt": texts, "max_tokens": 12, "temperature": 0, "return_token_ids": True}
    whole = _post(server, "/v1/completions", body).json()
    text_ids = [_post(server, "/tokenize", {"prompt": t}).json()["tokens"] for t in texts]
    by_index = {c["index"]: c for c in whole["choices"]}
    assert [by_index[i]["prompt_token_ids"] for i in (0, 1)] == text_ids
    assert sum(len(c["token_ids"]) for c in whole["choices"]) == whole["usage"]["completion_tokens"]
    for c in whole["choices"]:
        assert _post(server, "/detokenize", {"tokens": c["token_ids"]}).json()["prompt"] == c["text"]
    streamed, prompts, _ = _streamed_ids(server, "/v1/completions", body)
    assert streamed == {i: by_index[i]["token_ids"] for i in (0, 1)}
    assert sorted(prompts) == sorted(text_ids)
    ids_prompt = [504, 3458, 28]
    as_ids = _post(server, "/v1/completions", {**body, "prompt": ids_prompt}).json()["choices"][0]
    assert as_ids["prompt_token_ids"] == ids_prompt and len(as_ids["token_ids"]) == 12
    messages = [{"role": "user", "content": "Name a colour."}]
    chat_body = {"model": MODEL, "messages": messages, "max_tokens": 8, "temperature": 0, "return_token_ids": True}
    chat = _post(server, "/v1/chat/completions", chat_body).json()
    rendered = _post(server, "/tokenize", {"messages": messages, "add_generation_prompt": True}).json()["tokens"]
    assert chat["prompt_token_ids"] == rendered
    assert len(chat["choices"][0]["token_ids"]) == chat["usage"]["completion_tokens"]
    streamed, prompts, _ = _streamed_ids(server, "/v1/chat/completions", chat_body)
    assert streamed == {0: chat["choices"][0]["token_ids"]} and prompts == [rendered]
    plain = _post(server, "/v1/completions", {**body, "return_token_ids": False}).json()
    assert all("token_ids" not in c and "prompt_token_ids" not in c for c in plain["choices"])
    _, prompts, chunks = _streamed_ids(server, "/v1/completions", {**body, "return_token_ids": False})
    assert not prompts and all("token_ids" not in c for chunk in chunks for c in chunk["choices"])
    assert _post(server, "/v1/completions", {**body, "return_token_ids": 1}).status_code == 400


def test_a_turn_sent_as_the_models_own_ids_hits_the_prefix_cache(server):
    """The use the ids serve: the next turn as prompt ids + the model's ids + new ids finds the
    previous turn's blocks, its answer's included, in the prefix cache."""
    body = {"model": MODEL, "prompt": "Once upon a time, in a quiet village by the sea,", "max_tokens": 40,
            "temperature": 0, "return_token_ids": True, "ignore_eos": True}
    first = _post(server, "/v1/completions", body).json()["choices"][0]
    history = first["prompt_token_ids"] + first["token_ids"]
    second = _post(server, "/v1/completions", {"model": MODEL, "prompt": history + [504, 3458], "max_tokens": 1,
                                               "temperature": 0}).json()
    cached = second["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert len(first["prompt_token_ids"]) < cached <= len(history)
