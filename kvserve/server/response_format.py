"""Structured-output request fields -> one ``StructuredSpec`` (HTTP process, no torch).

OpenAI's ``response_format`` (``text``, ``json_object``, ``json_schema``) and vLLM's
extensions ``guided_json``, ``guided_regex``, ``guided_choice``, ``guided_grammar`` and
``structured_outputs`` (``{"json" | "regex" | "choice" | "grammar": ...}``). At most one
may ask for a constraint. A schema is checked here (``check_schema``: the shape of every
subschema, known types, sane bounds, local ``$ref``s that resolve, patterns that
compile), so a bad one is a 400 naming the field before the engine sees the request;
the engine compiles it once more (xgrammar) and refuses what it cannot compile.
"""
from __future__ import annotations

import json
import re
from typing import Any

from kvserve.engine.structured_spec import StructuredKind, StructuredSpec
from kvserve.errors import InvalidRequestError

MAX_SPEC_CHARS = 64_000          # a schema / regex / grammar, as JSON text
MAX_CHOICES = 256
MAX_REPEAT = 10_000              # minLength / maxLength / minItems / maxItems beyond this: refused
_COUNTS = ("minLength", "maxLength", "minItems", "maxItems", "minProperties", "maxProperties")
JSON_TYPES = frozenset({"object", "array", "string", "number", "integer", "boolean", "null"})
_SUBSCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_SUBSCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_SUBSCHEMAS = ("items", "additionalProperties", "not", "contains", "propertyNames", "if", "then", "else",
               "unevaluatedProperties", "additionalItems")
_BOUNDS = (("minimum", "maximum"), ("exclusiveMinimum", "exclusiveMaximum"), ("minLength", "maxLength"),
           ("minItems", "maxItems"), ("minProperties", "maxProperties"))


def _bad(param: str, message: str) -> InvalidRequestError:
    return InvalidRequestError(message, param=param)


def _dump(value: Any, param: str) -> str:
    text = json.dumps(value, ensure_ascii=False)
    if len(text) > MAX_SPEC_CHARS:
        raise _bad(param, f"the constraint is longer than {MAX_SPEC_CHARS} characters")
    return text


def check_schema(schema: Any, param: str, root: Any = None) -> None:
    """Raise a 400 naming ``param`` (plus the JSON path) if ``schema`` is no usable JSON schema."""
    root = schema if root is None else root
    if isinstance(schema, bool):
        return
    if not isinstance(schema, dict):
        raise _bad(param, "a JSON schema must be an object (or a boolean)")
    kind = schema.get("type")
    kinds = kind if isinstance(kind, list) else [kind] if kind is not None else []
    for k in kinds:
        if k not in JSON_TYPES:
            raise _bad(param, f"unknown JSON schema type {k!r} (expected one of {sorted(JSON_TYPES)})")
    _check_keywords(schema, param)
    _check_ref(schema.get("$ref"), param, root)
    for key in _SUBSCHEMA_MAPS:
        if key in schema:
            if not isinstance(schema[key], dict):
                raise _bad(f"{param}.{key}", f"{key} must be an object of schemas")
            for name, sub in schema[key].items():
                check_schema(sub, f"{param}.{key}.{name}", root)
    for key in _SUBSCHEMA_LISTS:
        if key in schema:
            if not isinstance(schema[key], list) or not schema[key]:
                raise _bad(f"{param}.{key}", f"{key} must be a non-empty list of schemas")
            for i, sub in enumerate(schema[key]):
                check_schema(sub, f"{param}.{key}[{i}]", root)
    for key in _SUBSCHEMAS:
        if key in schema:
            check_schema(schema[key], f"{param}.{key}", root)


def _check_keywords(schema: dict, param: str) -> None:
    required = schema.get("required")
    if required is not None and (not isinstance(required, list) or not all(isinstance(r, str) for r in required)):
        raise _bad(f"{param}.required", "required must be a list of property names")
    if "enum" in schema and (not isinstance(schema["enum"], list) or not schema["enum"]):
        raise _bad(f"{param}.enum", "enum must be a non-empty list")
    for key in _COUNTS:
        value = schema.get(key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_REPEAT):
            raise _bad(f"{param}.{key}", f"{key} must be an integer from 0 to {MAX_REPEAT}")
    for low, high in _BOUNDS:
        for key in (low, high):
            value = schema.get(key)
            if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))):
                raise _bad(f"{param}.{key}", f"{key} must be a number")
        if schema.get(low) is not None and schema.get(high) is not None and schema[low] > schema[high]:
            raise _bad(f"{param}.{low}", f"{low} is greater than {high}: no value can match")
    pattern = schema.get("pattern")
    if pattern is not None:
        if not isinstance(pattern, str):
            raise _bad(f"{param}.pattern", "pattern must be a string")
        try:
            re.compile(pattern)
        except re.error as exc:
            raise _bad(f"{param}.pattern", f"pattern is not a valid regular expression: {exc}") from exc


def _check_ref(ref: Any, param: str, root: Any) -> None:
    if ref is None:
        return
    if not isinstance(ref, str) or not ref.startswith("#"):
        raise _bad(f"{param}.$ref", "only local references ('#/...') are supported")
    node = root
    for part in [p for p in ref[1:].split("/") if p]:
        part = part.replace("~1", "/").replace("~0", "~")
        if not isinstance(node, dict) or part not in node:
            raise _bad(f"{param}.$ref", f"the reference {ref!r} does not resolve")
        node = node[part]


def schema_spec(schema: Any, param: str) -> StructuredSpec:
    """A checked JSON schema (an object, or its JSON text) as a spec."""
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except ValueError as exc:
            raise _bad(param, f"the schema is not valid JSON: {exc}") from exc
    if not isinstance(schema, dict):
        raise _bad(param, "a JSON schema must be an object")
    check_schema(schema, param)
    return StructuredSpec(StructuredKind.JSON_SCHEMA, _dump(schema, param))


def regex_spec(value: Any, param: str) -> StructuredSpec:
    if not isinstance(value, str) or not value:
        raise _bad(param, "a regex constraint must be a non-empty string")
    try:
        re.compile(value)
    except re.error as exc:
        raise _bad(param, f"not a valid regular expression: {exc}") from exc
    _dump(value, param)
    return StructuredSpec(StructuredKind.REGEX, value)


def choice_spec(value: Any, param: str) -> StructuredSpec:
    if (not isinstance(value, list) or not value or len(value) > MAX_CHOICES
            or not all(isinstance(c, str) and c for c in value)):
        raise _bad(param, f"choice must be a list of 1 to {MAX_CHOICES} non-empty strings")
    return StructuredSpec(StructuredKind.CHOICE, _dump(value, param))


def grammar_spec(value: Any, param: str) -> StructuredSpec:
    if not isinstance(value, str) or "::=" not in value:
        raise _bad(param, "a grammar must be an EBNF string with a 'root ::= ...' rule")
    _dump(value, param)
    return StructuredSpec(StructuredKind.GRAMMAR, value)


def response_format_spec(name: str, value: Any) -> StructuredSpec | None:
    """OpenAI ``response_format`` -> a spec (None for ``text`` or null)."""
    if value is None:
        return None
    if not isinstance(value, dict) or value.get("type") not in ("text", "json_object", "json_schema"):
        raise _bad(f"{name}.type", 'response_format.type must be "text", "json_object" or "json_schema"')
    kind = value["type"]
    extra = set(value) - {"type", "json_schema"}
    if extra or (kind != "json_schema" and "json_schema" in value):
        raise _bad(name, f"unexpected key in response_format: {sorted(extra or {'json_schema'})[0]!r}")
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredSpec(StructuredKind.JSON_OBJECT, "")
    inner = value.get("json_schema")
    if not isinstance(inner, dict):
        raise _bad(f"{name}.json_schema", 'type "json_schema" needs a json_schema object with a schema')
    unknown = set(inner) - {"name", "schema", "strict", "description"}
    if unknown:
        raise _bad(f"{name}.json_schema", f"unexpected key in json_schema: {sorted(unknown)[0]!r}")
    label = inner.get("name")
    if label is not None and (not isinstance(label, str) or not re.fullmatch(r"[A-Za-z0-9_-]{1,64}", label)):
        raise _bad(f"{name}.json_schema.name", "name must be 1 to 64 letters, digits, '_' or '-'")
    if "strict" in inner and inner["strict"] is not None and not isinstance(inner["strict"], bool):
        raise _bad(f"{name}.json_schema.strict", "strict must be a boolean")
    if "schema" not in inner:
        raise _bad(f"{name}.json_schema.schema", "json_schema needs a schema")
    return schema_spec(inner["schema"], f"{name}.json_schema.schema")


def structured_outputs_spec(name: str, value: Any) -> StructuredSpec | None:
    """vLLM's ``structured_outputs``: exactly one of json / regex / choice / grammar."""
    if value is None:
        return None
    makers = {"json": schema_spec, "regex": regex_spec, "choice": choice_spec, "grammar": grammar_spec}
    if not isinstance(value, dict):
        raise _bad(name, "structured_outputs must be an object")
    unknown = set(value) - set(makers)
    if unknown:
        raise _bad(f"{name}.{sorted(unknown)[0]}", f"unsupported structured_outputs key {sorted(unknown)[0]!r}")
    given = [k for k in makers if value.get(k) is not None]
    if len(given) != 1:
        raise _bad(name, "structured_outputs needs exactly one of json, regex, choice, grammar")
    return makers[given[0]](value[given[0]], f"{name}.{given[0]}")


GUIDED = {"guided_json": schema_spec, "guided_regex": regex_spec, "guided_choice": choice_spec,
          "guided_grammar": grammar_spec}


def guided_checker(name: str):
    """The field checker of one ``guided_*`` extension (null = not asked)."""
    make = GUIDED[name]

    def check(field: str, value: Any) -> StructuredSpec | None:
        return None if value is None else make(value, field)
    return check


STRUCTURED_FIELDS = ("response_format", "structured_outputs", *GUIDED)


def structured_from(values: dict) -> StructuredSpec | None:
    """The one spec the checked fields ask for (a 400 if several do)."""
    asked = [(name, values[name]) for name in STRUCTURED_FIELDS if values.get(name) is not None]
    if len(asked) > 1:
        raise _bad(asked[1][0], f"{asked[0][0]} and {asked[1][0]} both constrain the output; send one")
    return asked[0][1] if asked else None
