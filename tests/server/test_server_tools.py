"""Tool calling end to end through the OpenAI SDK: forced calls (``required``, a named
function) parse and validate against the tool's schema, a two-turn conversation (call ->
tool result -> answer), streamed tool-call deltas assemble to the non-streamed call
(greedy), and the 400s name the field.

The forced calls rely on the engine's constrained decoding (``GenerateSpec.structured``,
a JSON schema): without it the 135M model does not reliably write the call's JSON.
"""
from __future__ import annotations

import asyncio
import json

import jsonschema
import openai
import pytest


pytestmark = pytest.mark.model

MODEL = "SmolLM2-135M-Instruct"


def _tool(name: str, description: str, parameters: dict) -> dict:
    return {"type": "function", "function": {"name": name, "description": description, "parameters": parameters}}


WEATHER = _tool("get_weather", "Get the current weather in a city", {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 40},
                                     "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
    "required": ["city", "unit"], "additionalProperties": False})
ADD = _tool("add", "Add two integers", {
    "type": "object", "properties": {"a": {"type": "integer", "minimum": -1000, "maximum": 1000},
                                     "b": {"type": "integer", "minimum": -1000, "maximum": 1000}},
    "required": ["a", "b"], "additionalProperties": False})
BOOK = _tool("book_flight", "Book a flight", {
    "type": "object", "properties": {
        "origin": {"type": "string", "pattern": "^[A-Z]{3}$"},
        "destination": {"type": "string", "pattern": "^[A-Z]{3}$"},
        "passengers": {"type": "array", "items": {"type": "object", "properties": {
            "name": {"type": "string", "maxLength": 30}, "age": {"type": "integer", "minimum": 0, "maximum": 120}},
            "required": ["name", "age"], "additionalProperties": False}, "minItems": 1, "maxItems": 2},
        "direct": {"type": "boolean"}},
    "required": ["origin", "destination", "passengers"], "additionalProperties": False})
TOOLS = [WEATHER, ADD, BOOK]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
QUESTIONS = {"get_weather": "What is the weather like in Paris today?", "add": "What is 17 plus 25?",
             "book_flight": "Book me a direct flight from Boston (BOS) to Lisbon (LIS) for Ann, 34."}


def _named(name: str) -> dict:
    return {"type": "function", "function": {"name": name}}


def _check_calls(message, allowed: set[str]) -> list:
    """Every call parses and validates against its tool's schema; the calls."""
    assert message.content is None and message.tool_calls
    for call in message.tool_calls:
        assert call.type == "function" and call.id.startswith("call_")
        assert call.function.name in allowed
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
    return message.tool_calls


def _aclient(open_server) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=open_server.base_url, api_key="none", max_retries=0, timeout=300)


async def _forced(open_server, question: str, choice, parallel: bool | None, n: int, temperature: float):
    async with _aclient(open_server) as aclient:
        extra = {} if parallel is None else {"parallel_tool_calls": parallel}
        return await aclient.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": question}], tools=TOOLS, tool_choice=choice,
            max_tokens=160, temperature=temperature, n=n, seed=1, **extra)


def test_forced_calls_parse_and_validate(open_server):
    """Named and required calls, greedy and sampled (n=2), one call or parallel: every
    choice is a call of an allowed tool whose arguments validate (requests run together)."""
    cases = [(QUESTIONS[name], _named(name), None, 1, 0.0, {name}) for name in QUESTIONS]
    cases += [(QUESTIONS["book_flight"], _named("book_flight"), None, 2, 1.0, {"book_flight"}),
              (QUESTIONS["get_weather"], "required", False, 1, 0.0, set(SCHEMAS)),
              (QUESTIONS["add"], "required", True, 2, 1.0, set(SCHEMAS))]

    async def run():
        return await asyncio.gather(*(_forced(open_server, q, c, p, n, t) for q, c, p, n, t, _ in cases))

    for (_, choice, parallel, n, _, allowed), response in zip(cases, asyncio.run(run())):
        assert len(response.choices) == n
        for choice_out in response.choices:
            calls = _check_calls(choice_out.message, allowed)
            assert choice_out.finish_reason == "tool_calls"
            if parallel is not True:
                assert len(calls) == 1


def test_two_turn_conversation(open_client):
    """call -> tool result -> an answer in words."""
    question = [{"role": "user", "content": QUESTIONS["get_weather"]}]
    first = open_client.chat.completions.create(model=MODEL, messages=question, tools=TOOLS,
                                                tool_choice=_named("get_weather"), max_tokens=80, temperature=0)
    (call,) = _check_calls(first.choices[0].message, {"get_weather"})
    history = question + [first.choices[0].message.model_dump(exclude_none=True),
                          {"role": "tool", "tool_call_id": call.id, "content": '{"temperature": 18, "sky": "sunny"}'}]
    second = open_client.chat.completions.create(model=MODEL, messages=history, tools=TOOLS, tool_choice="none",
                                                 max_tokens=30, temperature=0)
    answer = second.choices[0]
    assert answer.message.tool_calls is None and answer.message.content.strip()
    assert answer.finish_reason in ("stop", "length")


async def _whole_and_streamed(open_server, question: str, choice) -> tuple:
    kwargs = dict(model=MODEL, messages=[{"role": "user", "content": question}], tools=TOOLS,
                  tool_choice=choice, max_tokens=80, temperature=0)
    async with _aclient(open_server) as aclient:
        async def streamed():
            async with aclient.chat.completions.stream(**kwargs) as stream:
                async for _ in stream:
                    pass
                return stream.current_completion_snapshot.choices[0]   # the SDK's assembly of the deltas
        whole = aclient.chat.completions.create(**kwargs)
        return tuple(await asyncio.gather(whole, streamed()))


def test_streamed_calls_assemble_to_the_whole_calls(open_server):
    """Greedy: the SDK's assembly of the streamed deltas equals the whole response, for a
    named function (nested arguments), required (an array of calls) and auto (requests run
    together)."""
    cases = [(QUESTIONS["book_flight"], _named("book_flight")), (QUESTIONS["add"], "required"),
             (QUESTIONS["add"], "auto")]
    choices = [choice for _, choice in cases]

    async def run():
        return await asyncio.gather(*(_whole_and_streamed(open_server, q, c) for q, c in cases))

    def calls(message):
        return [(c.type, c.function.name, c.function.arguments) for c in message.tool_calls or []]

    for choice, (whole, streamed) in zip(choices, asyncio.run(run())):
        whole = whole.choices[0]
        assert streamed.finish_reason == whole.finish_reason
        assert streamed.message.content == whole.message.content
        assert calls(streamed.message) == calls(whole.message)
        assert all(c.id.startswith("call_") for c in streamed.message.tool_calls or [])
        if choice != "auto":
            assert calls(whole.message) and whole.finish_reason == "tool_calls"


@pytest.mark.parametrize("body, param", [
    ({"tools": [WEATHER, WEATHER]}, "tools[1].function.name"),
    ({"tools": TOOLS, "tool_choice": _named("nope")}, "tool_choice.function.name"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"messages": [{"role": "user", "content": "hi"}, {"role": "tool", "content": "18C"}]},
     "messages[1].tool_call_id"),
])
def test_bad_tool_requests_name_the_field(open_client, body, param):
    body = {"messages": [{"role": "user", "content": "hi"}], **body}
    with pytest.raises(openai.BadRequestError) as caught:
        open_client.chat.completions.create(model=MODEL, max_tokens=2, **body)
    assert caught.value.param == param


def test_parallel_tool_calls_accepted_without_tools(open_client):
    reply = open_client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=2,
                                                parallel_tool_calls=False)
    assert reply.choices[0].message.tool_calls is None
