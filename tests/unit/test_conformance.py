"""Tier 1: the OpenAI conformance fixes that need no model (issue 18's "conformance gaps").

- /openapi.json's request schemas are derived from protocol.py's checkers: for every
  described field, a checker accepts a value exactly when the published schema does
  (fixed edge values plus hypothesis-generated JSON values);
- message roles (unknown -> 400 naming ``messages[i].role``; ``developer`` -> system);
- the newer SDK fields (``prompt_cache_key``, ``safety_identifier``, ``store``,
  ``metadata``, ``parallel_tool_calls`` without tools);
- logprob spelling of partial-UTF-8 tokens and the end-of-turn token, on a tiny real
  GGUF tokenizer (byte-level BPE, like the default model's).
"""
from __future__ import annotations

import re

import jsonschema_rs
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvserve.errors import InvalidRequestError
from kvserve.frontend.outputs import CompletionOutput
from kvserve.server import openapi, protocol
from kvserve.server.responses import ResponseBuilder, TokenSpeller, completion_logprobs
from kvserve.tokenizer import Tokenizer
from kvserve.tokenizer.gguf_vocab import bytes_to_unicode

TABLES = {"completion": protocol.COMPLETION_FIELDS, "chat": protocol.CHAT_FIELDS,
          "tokenize": protocol.TOKENIZE_FIELDS, "detokenize": protocol.DETOKENIZE_FIELDS}
# Fields whose checkers belong to structured output / tool calling (other parts of issue 18):
# their values (JSON schemas, regexes, grammars, tools) cannot be described exactly, so a schema
# they publish need only be sound (it accepts whatever the checker accepts), or absent ("any value").
OWNED_ELSEWHERE = {"response_format", "structured_outputs", "guided_json", "guided_regex", "guided_choice",
                   "guided_grammar", "tools", "functions", "tool_choice", "function_call"}
EDGE_VALUES = [None, True, False, 0, 1, -1, 3.0, 2.5, -2.5, 1e-9, 100, 101, -101, 2**63 - 1, 2**63, -(2**63), 2**64,
               "", "x", "default", "flex", "x" * 257, [], [0], [1, 2], [1.0], [-1], ["a"], [["a"]], [[1]], [[]],
               {}, {"include_usage": True}, {"include_usage": 1}, {"1": 5}, {"01": 5}, {"1": 101}, {"a": "b"},
               {"k": 1}, {"9" * 19: 1}, [{"role": "user", "content": "hi"}], [{"role": "robot"}], [{"content": "x"}],
               [{"role": "developer", "content": "x"}], ["x"] * 33, [[1]] * 33]
JSON = st.recursive(st.none() | st.booleans() | st.integers(-(2**64), 2**64) | st.floats(allow_nan=False,
                    allow_infinity=False) | st.text(max_size=8),
                    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=4), inner, max_size=4),
                    max_leaves=12)


def _accepts(check, name: str, value) -> bool:
    try:
        check(name, value)
    except InvalidRequestError:
        return False
    return True


def _described_fields(exact: bool = True) -> list[tuple[str, str]]:
    """(table, field) of the checkers that publish a schema: the exact ones, or the others."""
    return [(table, name) for table, fields in TABLES.items() for name, check in fields.items()
            if getattr(check, "schema", None) and (name not in OWNED_ELSEWHERE) == exact]


def test_every_field_but_the_tool_and_format_ones_publishes_a_schema():
    undescribed = {name for fields in TABLES.values() for name, check in fields.items()
                   if not getattr(check, "schema", None)}
    assert undescribed <= OWNED_ELSEWHERE, undescribed
    assert len(_described_fields()) >= 50


@pytest.mark.parametrize("table,name", _described_fields())
def test_schema_agrees_with_checker_on_edge_values(table, name):
    check = TABLES[table][name]
    validator = jsonschema_rs.validator_for(check.schema)
    for value in EDGE_VALUES:
        assert _accepts(check, name, value) == validator.is_valid(value), (name, value)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(field=st.sampled_from(_described_fields()), value=JSON)
def test_schema_agrees_with_checker_on_generated_values(field, value):
    table, name = field
    check = TABLES[table][name]
    assert _accepts(check, name, value) == jsonschema_rs.is_valid(check.schema, value), (name, value)


def test_loose_schemas_accept_what_their_checkers_accept():
    for table, name in _described_fields(exact=False):
        check = TABLES[table][name]
        for value in EDGE_VALUES:
            if _accepts(check, name, value):
                assert jsonschema_rs.is_valid(check.schema, value), (name, value)


def test_openapi_request_bodies_come_from_the_tables():
    bodies = openapi.request_bodies()
    chat = bodies["/v1/chat/completions"]
    assert set(chat["properties"]) == set(protocol.CHAT_FIELDS) and chat["required"] == ["messages"]
    assert chat["additionalProperties"] is False
    assert chat["properties"]["temperature"] is protocol.CHAT_FIELDS["temperature"].schema
    assert bodies["/v1/completions"]["required"] == ["prompt"]
    tokenize = jsonschema_rs.validator_for(bodies["/tokenize"])
    for body, ok in [({"prompt": "a"}, True), ({"messages": [{"role": "user", "content": "a"}]}, True),
                     ({"prompt": "a", "messages": []}, False), ({}, False), ({"prompt": None, "messages": None}, False),
                     ({"prompt": "a", "extra": 1}, False)]:
        assert tokenize.is_valid(body) == ok, body
        assert _parses(protocol.parse_tokenize, body) == ok, body


def _parses(parse, body) -> bool:
    try:
        parse(body)
    except InvalidRequestError:
        return False
    return True


# ----------------------------------------------------------------- messages
def test_unknown_role_names_its_index():
    messages = [{"role": "user", "content": "a"}, {"role": "robot", "content": "b"}]
    with pytest.raises(InvalidRequestError) as info:
        protocol.parse_chat({"messages": messages})
    assert info.value.param == "messages[1].role" and "robot" in info.value.message
    with pytest.raises(InvalidRequestError) as info:
        protocol.parse_tokenize({"messages": [{"content": "x"}]})
    assert info.value.param == "messages[0].role"


def test_developer_is_system_and_tool_role_accepted():
    spec = protocol.parse_chat({"messages": [{"role": "developer", "content": "be brief"},
                                             {"role": "user", "content": "hi"}]})
    assert [m["role"] for m in spec.messages] == ["system", "user"]
    assert spec.messages[0]["content"] == "be brief"
    body = {"messages": [{"role": "tool", "content": "42", "tool_call_id": "c1"}]}
    assert protocol.check_fields(body, protocol.CHAT_FIELDS)["messages"][0]["role"] == "tool"


# ------------------------------------------------------------- new SDK fields
def test_new_sdk_fields():
    spec = protocol.parse_chat({"messages": [{"role": "user", "content": "x"}], "prompt_cache_key": "conv-7",
                                "safety_identifier": "u-1", "store": False, "metadata": {"a": "b"},
                                "parallel_tool_calls": False})
    assert spec.prompt_cache_key == "conv-7" and spec.safety_identifier == "u-1"
    spec = protocol.parse_completion({"prompt": "x", "prompt_cache_key": "k", "metadata": None, "store": None})
    assert spec.prompt_cache_key == "k"
    bad = [("store", True), ("prompt_cache_key", 5), ("safety_identifier", "x" * 300),
           ("metadata", {f"k{i}": "v" for i in range(17)}), ("metadata", {"k": 1}), ("metadata", {"k" * 65: "v"}),
           ("parallel_tool_calls", "yes")]
    for name, value in bad:
        with pytest.raises(InvalidRequestError) as info:
            protocol.parse_chat({"messages": [{"role": "user", "content": "x"}], name: value})
        assert info.value.param == name, (name, value)


# ------------------------------------------------------------------ logprobs
@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Tokenizer:
    """A byte-level BPE GGUF vocabulary: the 256 byte tokens, two words, <|im_end|> (EOS)."""
    gguf = pytest.importorskip("gguf")
    b2u = bytes_to_unicode()
    tokens = [b2u[i] for i in range(256)] + ["he", "ll", "hell", "hello", "<|im_end|>"]
    path = str(tmp_path_factory.mktemp("tiny") / "tiny.gguf")
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("llama-bpe")
    writer.add_token_list(tokens)
    writer.add_token_types([1] * 260 + [3])
    writer.add_token_merges(["h e", "l l", "he ll", "hell o"])
    writer.add_eos_token_id(260)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return Tokenizer.load(path)


def _join(tokens: list[str]) -> str:
    """The text a client rebuilds from logprob tokens: ``bytes:\\xNN`` spellings give bytes."""
    out = b""
    for token in tokens:
        if token.startswith("bytes:"):
            out += bytes(int(h, 16) for h in re.findall(r"\\x([0-9a-f]{2})", token[len("bytes:"):]))
        else:
            out += token.encode("utf-8")
    return out.decode("utf-8")


def test_emoji_bytes_are_spelled_apart_and_join_back(tiny):
    text = "hello 🍕!"
    ids = tiny.encode(text, add_special_tokens=False)
    assert len(ids) > 4                                     # the emoji is 4 byte tokens here
    entries = [{i: -1.0, **{j: -2.0 - k for k, j in enumerate(ids) if j != i}} for i in ids]
    lp = completion_logprobs(TokenSpeller(tiny), ids, entries, k=len(set(ids)), text_offset=0)
    assert _join(lp["tokens"]) == text
    assert sum(t.startswith("bytes:") for t in lp["tokens"]) == 4 and "\ufffd" not in "".join(lp["tokens"])
    assert all(len(top) == len(set(ids)) for top in lp["top_logprobs"])   # no key collides
    assert lp["text_offset"] == [0, 5, 6, 6, 6, 6, 7]                   # the emoji: one character at 6


def test_chat_logprobs_leave_out_the_end_of_turn_token(tiny):
    ids = tiny.encode("hello", add_special_tokens=False) + [tiny.eos_token_id]
    entries = [{i: -0.5} for i in ids]
    done = CompletionOutput(0, "hello", ids, "stop", None, entries)
    builder = ResponseBuilder("chat", "c", "m", TokenSpeller(tiny), logprobs=0, n=1)
    content = builder.chat_choice(0, done)["logprobs"]["content"]
    assert "".join(c["token"] for c in content) == done.text and len(content) == len(ids) - 1
    last = builder.chunk(0, "", [tiny.eos_token_id], [{tiny.eos_token_id: -0.1}], "stop", None)
    assert last["choices"][0]["logprobs"] is None
    shown = ResponseBuilder("chat", "c", "m", TokenSpeller(tiny), logprobs=0, n=1, skip_special_tokens=False)
    kept = shown.chat_choice(0, CompletionOutput(0, "hello<|im_end|>", ids, "stop", None, entries))
    assert "".join(c["token"] for c in kept["logprobs"]["content"]) == "hello<|im_end|>"
    cut = builder.chat_choice(0, CompletionOutput(0, "hello", ids[:-1], "length", None, entries[:-1]))
    assert len(cut["logprobs"]["content"]) == len(ids) - 1
