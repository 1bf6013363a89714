"""Tier 1: response_format / guided_* / structured_outputs -> StructuredSpec in the HTTP
process, and the 400s (with the field named) for what cannot be served."""
from __future__ import annotations

import json

import pytest

from kvserve.engine.structured_spec import StructuredKind, StructuredSpec
from kvserve.errors import InvalidRequestError
from kvserve.server.protocol import parse_chat, parse_completion

MESSAGES = [{"role": "user", "content": "hi"}]
SCHEMA = {"type": "object", "properties": {"b": {"type": "integer", "minimum": 0}, "a": {"type": "string"}},
          "required": ["b", "a"], "additionalProperties": False}


def chat(**fields):
    return parse_chat({"messages": MESSAGES, **fields})


def error(**fields) -> InvalidRequestError:
    with pytest.raises(InvalidRequestError) as err:
        chat(**fields)
    return err.value


def test_text_and_absent_mean_unconstrained():
    assert chat().structured is None
    assert chat(response_format={"type": "text"}).structured is None
    assert chat(response_format=None).structured is None


def test_json_object_and_json_schema_keep_the_schema_and_its_property_order():
    assert chat(response_format={"type": "json_object"}).structured == StructuredSpec(StructuredKind.JSON_OBJECT, "")
    spec = chat(response_format={"type": "json_schema",
                                 "json_schema": {"name": "rec", "schema": SCHEMA, "strict": True}}).structured
    assert spec.kind is StructuredKind.JSON_SCHEMA
    assert json.loads(spec.value) == SCHEMA and list(json.loads(spec.value)["properties"]) == ["b", "a"]


def test_vllm_extensions_on_both_endpoints():
    assert chat(guided_regex="[0-9]+").structured == StructuredSpec(StructuredKind.REGEX, "[0-9]+")
    assert chat(guided_choice=["yes", "no"]).structured == StructuredSpec(StructuredKind.CHOICE, '["yes", "no"]')
    assert chat(guided_json=json.dumps(SCHEMA)).structured.kind is StructuredKind.JSON_SCHEMA
    assert chat(guided_grammar='root ::= "x"').structured.kind is StructuredKind.GRAMMAR
    spec = parse_completion({"prompt": "p", "structured_outputs": {"choice": ["a", "b"]}}).structured
    assert spec == StructuredSpec(StructuredKind.CHOICE, '["a", "b"]')


@pytest.mark.parametrize("fields, param", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objekt"}}}},
     "response_format.json_schema.schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "object", "properties": {"n": {"type": "integer", "minimum": 5, "maximum": 1}}}}}},
     "response_format.json_schema.schema.properties.n.minimum"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"$ref": "#/$defs/no"}}}},
     "response_format.json_schema.schema.$ref"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "string", "pattern": "a(b"}}}}, "response_format.json_schema.schema.pattern"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format.json_schema.schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "bad name!", "schema": {}}}},
     "response_format.json_schema.name"),
    ({"response_format": {"type": "xml"}}, "response_format.type"),
    ({"guided_regex": "a(b"}, "guided_regex"),
    ({"guided_json": {"type": "string", "maxLength": 10**9}}, "guided_json.maxLength"),
    ({"guided_choice": []}, "guided_choice"),
    ({"guided_json": "{not json"}, "guided_json"),
    ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs"),
    ({"structured_outputs": {"xml": "a"}}, "structured_outputs.xml"),
    ({"guided_regex": "a", "response_format": {"type": "json_object"}}, "guided_regex"),
])
def test_unusable_constraints_are_a_400_naming_the_field(fields, param):
    assert error(**fields).param == param
