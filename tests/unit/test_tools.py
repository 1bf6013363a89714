"""Tier 1: tool calling without a model: request validation (400s naming the field),
the constrained call's JSON schema, prompt rendering (default block and a template that
reads ``tools``), output parsing, and streamed deltas assembling to the whole response."""
from __future__ import annotations

import json

import jsonschema
import pytest
from tokenizers import Tokenizer as BackendTokenizer
from tokenizers.models import WordLevel

from kvserve.engine.structured_spec import StructuredKind
from kvserve.errors import InvalidRequestError
from kvserve.frontend.outputs import CompletionOutput
from kvserve.server.protocol import parse_chat
from kvserve.server.responses import ResponseBuilder, TokenSpeller
from kvserve.server.tool_parser import ToolCallStream, final_message, parse_output
from kvserve.server.tool_prompt import default_messages, render_chat_prompt, template_declares_tools
from kvserve.server.tools import output_schema
from kvserve.tokenizer import Tokenizer

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"},
                                                    "unit": {"enum": ["celsius", "fahrenheit"]}},
                   "required": ["city"], "additionalProperties": False}}}
ADD = {"type": "function", "function": {
    "name": "add", "parameters": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                                  "required": ["a", "b"]}}}
USER = [{"role": "user", "content": "What is the weather in Paris?"}]
CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
TOOL_TEMPLATE = ("{% if tools %}TOOLS:{% for t in tools %} {{ t.function.name }}{% endfor %}\n{% endif %}"
                 "{% for m in messages %}{{ m.role }}: {{ m.content }}"
                 "{% if m.tool_calls %}{% for c in m.tool_calls %} CALL {{ c.function.name }} "
                 "{{ c.function.arguments | tojson }}{% endfor %}{% endif %}\n{% endfor %}")


def _chat(**body):
    return parse_chat({"messages": USER, **body})


def _bad_param(**body) -> str:
    with pytest.raises(InvalidRequestError) as caught:
        _chat(**body)
    return caught.value.param


def _tokenizer(template: str) -> Tokenizer:
    backend = BackendTokenizer(WordLevel({"[UNK]": 0, "a": 1}, unk_token="[UNK]"))
    return Tokenizer(backend, bos_token_id=None, eos_token_id=None, chat_template=template)


# ------------------------------------------------------------ validation
@pytest.mark.parametrize("body, param", [
    ({"tools": [WEATHER, {"type": "function", "function": {"name": "get_weather"}}]}, "tools[1].function.name"),
    ({"tools": [WEATHER, {"type": "function", "function": {"name": "bad name!"}}]}, "tools[1].function.name"),
    ({"tools": [{"type": "retrieval", "function": {"name": "x"}}]}, "tools[0].type"),
    ({"tools": [{"type": "function"}]}, "tools[0].function"),
    ({"tools": [{"type": "function", "function": {"name": "x", "parameters": "{}"}}]}, "tools[0].function.parameters"),
    ({"tools": [{"type": "function", "function": {"name": "x", "parameters": {"type": "array"}}}]},
     "tools[0].function.parameters"),
    ({"tools": [{"type": "function", "function": {"name": "x", "extra": 1}}]}, "tools[0].function.extra"),
    ({"tools": {"get_weather": WEATHER}}, "tools"),
    ({"tools": [WEATHER], "tool_choice": "always"}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "add"}}},
     "tool_choice.function.name"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": "add"}}, "tool_choice.function"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"parallel_tool_calls": "yes"}, "parallel_tool_calls"),
    ({"functions": [WEATHER["function"]]}, "functions"),
    ({"function_call": "auto"}, "function_call"),
])
def test_invalid_tool_fields_name_the_field(body, param):
    assert _bad_param(**body) == param


@pytest.mark.parametrize("messages, param", [
    ([*USER, {"role": "tool", "content": "18C"}], "messages[1].tool_call_id"),
    ([*USER, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": "{city"}}]}],
     "messages[1].tool_calls[0].function.arguments"),
    ([*USER, {"role": "assistant", "content": None, "tool_calls": [
        {"type": "function", "function": {"name": "get_weather", "arguments": "{}"}}]}],
     "messages[1].tool_calls[0].id"),
    ([*USER, {"role": "assistant", "content": None, "tool_calls": {"id": "x"}}], "messages[1].tool_calls"),
    ([{"role": "user", "content": "hi", "tool_calls": []}], "messages[0].tool_calls"),
])
def test_invalid_tool_messages_name_the_field(messages, param):
    with pytest.raises(InvalidRequestError) as caught:
        parse_chat({"messages": messages, "tools": [WEATHER]})
    assert caught.value.param == param


def test_tool_settings_accepted():
    assert _chat(parallel_tool_calls=False).tools is None                 # accepted without tools
    assert _chat(tools=[WEATHER], tool_choice="none").tools is None        # none: nothing shown or parsed
    assert _chat(tool_choice="none").tools is None
    auto = _chat(tools=[WEATHER, ADD])
    assert auto.tools.choice == "auto" and getattr(auto, "structured", None) is None
    named = _chat(tools=[WEATHER, ADD], tool_choice={"type": "function", "function": {"name": "add"}})
    assert (named.tools.choice, named.tools.function) == ("function", "add")
    assert named.structured.kind is StructuredKind.JSON_SCHEMA
    assert json.loads(named.structured.value) == output_schema(named.tools)


# ------------------------------------------------------------ constraint schema
@pytest.mark.parametrize("parallel", [True, False])
def test_required_schema_accepts_calls_of_every_tool_and_nothing_else(parallel):
    spec = _chat(tools=[WEATHER, ADD], tool_choice="required", parallel_tool_calls=parallel)
    schema = json.loads(spec.structured.value)
    jsonschema.Draft202012Validator.check_schema(schema)
    weather = {"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}
    add = {"name": "add", "arguments": {"a": 1, "b": 2}}
    wrong = [{"name": "add", "arguments": {"city": "Paris"}}, {"name": "nope", "arguments": {}},
             {"name": "get_weather", "arguments": {"city": "Paris", "extra": 1}}, {"name": "add"}]
    if parallel:
        jsonschema.validate([weather, add], schema)
        bad = [[], [weather, wrong[0]], weather] + [[w] for w in wrong]
    else:
        jsonschema.validate(weather, schema)
        jsonschema.validate(add, schema)
        bad = [[weather]] + wrong
    for value in bad:
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(value, schema)


def test_named_schema_is_that_tools_call():
    spec = _chat(tools=[WEATHER, ADD], tool_choice={"type": "function", "function": {"name": "get_weather"}})
    schema = json.loads(spec.structured.value)
    jsonschema.validate({"name": "get_weather", "arguments": {"city": "Oslo"}}, schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({"name": "add", "arguments": {"a": 1, "b": 2}}, schema)


# ------------------------------------------------------------ rendering
HISTORY = [*USER,
           {"role": "assistant", "content": None, "tool_calls": [
               {"id": "call_1", "type": "function", "function": {"name": "get_weather",
                                                                 "arguments": '{"city": "Paris"}'}}]},
           {"role": "tool", "tool_call_id": "call_1", "content": "18C and sunny"},
           {"role": "tool", "tool_call_id": "call_2", "content": [{"type": "text", "text": "second"}]}]


def test_template_tool_support_is_read_from_its_syntax():
    assert template_declares_tools(TOOL_TEMPLATE)
    assert not template_declares_tools(CHATML)
    assert not template_declares_tools("{# tools #}{{ messages }}")
    assert not template_declares_tools(None)


def test_default_rendering_lists_tools_and_spells_tool_turns():
    spec = parse_chat({"messages": HISTORY, "tools": [WEATHER, ADD]})
    text = render_chat_prompt(_tokenizer(CHATML), spec.messages, spec.tools)
    system, rest = text.split("<|im_end|>\n", 1)
    assert system.startswith("<|im_start|>system\n# Tools")
    for tool in (WEATHER, ADD):
        assert json.dumps(tool, ensure_ascii=False) in system
    assert ('<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
            "</tool_call><|im_end|>") in rest
    assert ("<|im_start|>user\n<tool_response>\n18C and sunny\n</tool_response>\n"
            "<tool_response>\nsecond\n</tool_response><|im_end|>") in rest
    assert rest.endswith("<|im_start|>assistant\n")


def test_default_block_joins_the_system_message_and_says_what_to_force():
    system = [{"role": "system", "content": "Be brief."}, *USER]
    named = parse_chat({"messages": system, "tools": [WEATHER],
                        "tool_choice": {"type": "function", "function": {"name": "get_weather"}}})
    out = default_messages(named.messages, named.tools)
    assert len(out) == 2 and out[0]["content"].startswith("Be brief.\n\n# Tools")
    assert "Call the function get_weather now" in out[0]["content"]
    assert default_messages(HISTORY, None)[0] == USER[0]        # tool_choice none: no block
    assert all("tool_calls" not in m for m in default_messages(HISTORY, None))


def test_template_with_tools_gets_them_and_parsed_arguments():
    spec = parse_chat({"messages": HISTORY[:2], "tools": [WEATHER, ADD]})
    text = render_chat_prompt(_tokenizer(TOOL_TEMPLATE), spec.messages, spec.tools)
    assert text.startswith("TOOLS: get_weather adduser: What is the weather in Paris?")
    assert 'CALL get_weather {"city": "Paris"}' in text


# ------------------------------------------------------------ parsing
def _config(choice="auto", **body):
    return _chat(tools=[WEATHER, ADD], tool_choice=choice, **body).tools


AUTO_OUTPUTS = [
    ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
     "Let me check.", [("get_weather", {"city": "Paris"})]),
    ('<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call>\n<tool_call>{"name": "get_weather", '
     '"arguments": "{\\"city\\": \\"Oslo\\"}"}</tool_call> trailing', None,
     [("add", {"a": 1, "b": 2}), ("get_weather", {"city": "Oslo"})]),
    ('<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}', None, [("add", {"a": 1, "b": 2})]),   # unclosed
    ("It is sunny in Paris.", "It is sunny in Paris.", []),
    ('<tool_call>{"name": "unknown", "arguments": {}}</tool_call>', '<tool_call>{"name": "unknown", "arguments": {}}'
     "</tool_call>", []),
    ("<tool_call>not json</tool_call>", "<tool_call>not json</tool_call>", []),
    ("a < b <tool", "a < b <tool", []),
    ("", None, []),
]
FORCED_OUTPUTS = [
    ('{"name": "get_weather", "arguments": {"city": "Pa\\"ris}", "unit": "celsius"}}', "required", False,
     [("get_weather", {"city": 'Pa"ris}', "unit": "celsius"})]),
    ('[{"name": "add", "arguments": {"a": 1, "b": 2}}, {"name":"get_weather","arguments":{"city":"[x]"}}]',
     "required", True, [("add", {"a": 1, "b": 2}), ("get_weather", {"city": "[x]"})]),
    ('{"arguments": {"a": 3, "b": 4}, "name": "add"}', {"type": "function", "function": {"name": "add"}}, True,
     [("add", {"a": 3, "b": 4})]),
]


@pytest.mark.parametrize("text, content, calls", AUTO_OUTPUTS)
def test_auto_output_parsing(text, content, calls):
    parsed = parse_output(text, _config(), final=True)
    assert parsed.content == content
    assert [(c.name, json.loads(c.arguments)) for c in parsed.calls] == calls


@pytest.mark.parametrize("text, choice, parallel, calls", FORCED_OUTPUTS)
def test_forced_output_parsing(text, choice, parallel, calls):
    parsed = parse_output(text, _config(choice, parallel_tool_calls=parallel), final=True)
    assert parsed.content is None
    assert [(c.name, json.loads(c.arguments)) for c in parsed.calls] == calls


def test_forced_output_cut_short_keeps_the_arguments_read():
    config = _config("required", parallel_tool_calls=False)
    parsed = parse_output('{"name": "get_weather", "arguments": {"city": "Par', config, final=True)
    assert [(c.name, c.arguments) for c in parsed.calls] == [("get_weather", '{"city": "Par')]
    message, finish = final_message(config, '{"name": "get_wea', "length")
    assert message == {"role": "assistant", "content": '{"name": "get_wea'} and finish == "length"


def test_whole_message_has_ids_null_content_and_tool_calls_finish():
    message, finish = final_message(_config("required", parallel_tool_calls=False), FORCED_OUTPUTS[0][0], "stop")
    assert finish == "tool_calls" and message["content"] is None
    (call,) = message["tool_calls"]
    assert call["id"].startswith("call_") and len(call["id"]) > 10 and call["type"] == "function"
    assert json.loads(call["function"]["arguments"]) == {"city": 'Pa"ris}', "unit": "celsius"}
    assert final_message(_config(), "plain answer", "stop") == ({"role": "assistant", "content": "plain answer"},
                                                                "stop")


# ------------------------------------------------------------ streaming
def _assemble(chunks: list[dict]) -> tuple[str | None, list[dict], str | None]:
    """What the OpenAI SDK assembles from chat chunks of one choice: content, calls, finish."""
    content, calls, finish = None, {}, None
    for chunk in chunks:
        (choice,) = chunk["choices"]
        delta = choice["delta"]
        if delta.get("content") is not None:
            content = (content or "") + delta["content"]
        for part in delta.get("tool_calls", []):
            call = calls.setdefault(part["index"], {"id": None, "type": None, "name": "", "arguments": ""})
            call["id"] = part.get("id") or call["id"]
            call["type"] = part.get("type") or call["type"]
            call["name"] += part.get("function", {}).get("name") or ""
            call["arguments"] += part.get("function", {}).get("arguments") or ""
        finish = choice["finish_reason"] or finish
    return content, [calls[i] for i in sorted(calls)], finish


def _stream_vs_whole(text: str, config, step: int):
    builder = ResponseBuilder("chat", "chatcmpl-1", "m", TokenSpeller(None), None, 1, tools=config)
    pieces = [text[i:i + step] for i in range(0, len(text), step)] or [""]
    chunks = [builder.chunk(0, piece, role=i == 0) for i, piece in enumerate(pieces)]
    chunks.append(builder.chunk(0, "", finish_reason="stop"))
    whole = builder.chat_choice(0, CompletionOutput(0, text, [], finish_reason="stop"))
    return _assemble(chunks), whole, chunks


@pytest.mark.parametrize("step", [1, 2, 5, 1000])
@pytest.mark.parametrize("text, choice, parallel", [(t, "auto", True) for t, _, _ in AUTO_OUTPUTS]
                         + [(t, c, p) for t, c, p, _ in FORCED_OUTPUTS])
def test_streamed_deltas_assemble_to_the_whole_response(text, choice, parallel, step):
    (content, calls, finish), whole, chunks = _stream_vs_whole(text, _config(choice, parallel_tool_calls=parallel),
                                                               step)
    message = whole["message"]
    assert finish == whole["finish_reason"]
    assert content == message["content"]
    expected = [(c["type"], c["function"]["name"], c["function"]["arguments"]) for c in message.get("tool_calls", [])]
    assert [(c["type"], c["name"], c["arguments"]) for c in calls] == expected
    assert all(c["id"].startswith("call_") for c in calls)
    firsts = [p for ch in chunks for p in ch["choices"][0]["delta"].get("tool_calls", []) if "id" in p]
    assert [p["index"] for p in firsts] == list(range(len(calls)))          # one first delta per call
    assert all(p["function"]["name"] for p in firsts)


def test_forced_stream_sends_arguments_as_they_come():
    text = FORCED_OUTPUTS[0][0]
    _, _, chunks = _stream_vs_whole(text, _config("required", parallel_tool_calls=False), 4)
    fragments = [p for ch in chunks for p in ch["choices"][0]["delta"].get("tool_calls", []) if "id" not in p]
    assert len(fragments) > 5                                 # fragments, not one piece at the end


def test_partial_stream_holds_back_a_possible_tag():
    stream = ToolCallStream(_config())
    assert stream.feed("Checking <tool", final=False) == ("Checking", [])
    content, calls = stream.feed('_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call>', final=False)
    assert content == "" and calls[0]["function"]["name"] == "add" and stream.called
    assert stream.finish_reason("stop") == "tool_calls" and stream.finish_reason("length") == "length"


def test_forced_call_and_response_format_conflict():
    body = {"tools": [WEATHER], "response_format": {"type": "json_object"}}
    assert _bad_param(tool_choice="required", **body) == "response_format"
    spec = _chat(tool_choice="auto", **body)                   # auto: the format constrains the output
    assert spec.tools.choice == "auto" and spec.structured.kind is StructuredKind.JSON_OBJECT
