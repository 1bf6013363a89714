"""Structured output over HTTP: response_format json_object / json_schema (strict), the vLLM
guided_* extensions, streamed and not, and 400s that name the field of a bad schema."""
from __future__ import annotations

import asyncio
import json

import httpx
import jsonschema
import openai
import pytest

from tests.support.json_schemas import SCHEMAS

pytestmark = pytest.mark.model

MODEL = "SmolLM2-135M-Instruct"
SCHEMA = {"type": "object", "properties": {
    "city": {"type": "string", "minLength": 1, "maxLength": 16},
    "temperature": {"type": "integer", "minimum": -30, "maximum": 45},
    "unit": {"enum": ["celsius", "fahrenheit"]}}, "required": ["city", "temperature", "unit"],
    "additionalProperties": False}
MESSAGES = [{"role": "user", "content": "What is the weather in Paris? Answer in JSON."}]


def schema_format(strict: bool = True) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "weather", "schema": SCHEMA, "strict": strict}}


def test_json_schema_strict_not_streamed(open_client):
    out = open_client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=64, temperature=0,
                                              response_format=schema_format())
    choice = out.choices[0]
    jsonschema.validate(json.loads(choice.message.content), SCHEMA)
    assert choice.finish_reason == "stop"


def test_json_schema_streamed_sampled_n2(open_client):
    stream = open_client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=64, temperature=0.9, n=2,
                                                 seed=5, stream=True, response_format=schema_format())
    texts, reasons = {}, {}
    for chunk in stream:
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + (c.delta.content or "")
            if c.finish_reason:
                reasons[c.index] = c.finish_reason
    assert sorted(texts) == [0, 1] and reasons == {0: "stop", 1: "stop"}
    for text in texts.values():
        jsonschema.validate(json.loads(text), SCHEMA)


async def _whole_and_streamed(base_url: str, name: str) -> tuple[str, str, str, str]:
    """One greedy request under schema ``name``, whole and streamed: (text, finish) of each."""
    kwargs = dict(model=MODEL, messages=[{"role": "user", "content": "Reply with a JSON object that fits the task."}],
                  max_tokens=96, temperature=0, response_format={"type": "json_schema", "json_schema": {
                      "name": name, "schema": SCHEMAS[name], "strict": True}})
    async with openai.AsyncOpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=300) as aclient:
        whole = await aclient.chat.completions.create(**kwargs)
        text, finish = "", None
        async for chunk in await aclient.chat.completions.create(stream=True, **kwargs):
            for c in chunk.choices:
                text += c.delta.content or ""
                finish = c.finish_reason or finish
    return whole.choices[0].message.content, whole.choices[0].finish_reason, text, finish


def test_every_schema_streamed_equals_whole_and_validates(open_server):
    """All the schemas of tests/support/json_schemas.py through the HTTP server, greedy: the
    streamed text equals the whole response's, both end by the grammar and validate."""
    async def run_all():
        return await asyncio.gather(*(_whole_and_streamed(open_server.base_url, name) for name in SCHEMAS))
    results = asyncio.run(run_all())
    for name, (whole, whole_finish, streamed, streamed_finish) in zip(SCHEMAS, results):
        assert streamed == whole and whole_finish == streamed_finish == "stop", name
        jsonschema.validate(json.loads(whole), SCHEMAS[name])


def test_json_object(open_client):
    out = open_client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=64, temperature=0,
                                              response_format={"type": "json_object"})
    content = out.choices[0].message.content
    if out.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(content), dict)
    else:                                     # cut by max_tokens: still a prefix of an object
        assert content.startswith("{")


def test_guided_choice_on_completions(open_server):
    body = {"model": MODEL, "prompt": "Is the sky blue? Answer:", "max_tokens": 8, "temperature": 0,
            "guided_choice": ["yes", "no"]}
    out = httpx.post(f"{open_server.base_url}/completions", json=body, timeout=120).json()
    assert out["choices"][0]["text"] in ("yes", "no")
    assert out["choices"][0]["finish_reason"] == "stop"


@pytest.mark.parametrize("response_format, param", [
    ({"type": "json_schema", "json_schema": {"name": "w", "schema": {"type": "objekt"}}},
     "response_format.json_schema.schema"),
    ({"type": "json_schema", "json_schema": {"name": "w", "schema": {"type": "object", "properties": {
        "n": {"type": "integer", "minimum": 9, "maximum": 1}}}}}, "response_format.json_schema.schema.properties.n.minimum"),
    ({"type": "yaml"}, "response_format.type"),
])
def test_invalid_schema_is_a_400_naming_the_field(open_server, response_format, param):
    body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 8, "response_format": response_format}
    resp = httpx.post(f"{open_server.base_url}/chat/completions", json=body, timeout=60)
    assert resp.status_code == 400
    assert resp.json()["error"]["param"] == param


def test_regex_the_engine_cannot_compile_is_a_400(open_server):
    body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 8, "guided_grammar": "root ::= missing_rule"}
    resp = httpx.post(f"{open_server.base_url}/chat/completions", json=body, timeout=60)
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "guided_grammar"
