"""A request body -> a JSON object: UTF-8, strict JSON (no NaN/Infinity), bounded nesting,
no lone UTF-16 surrogates. Field checks come after, in ``protocol.py``."""
from __future__ import annotations

import json
import re
from typing import Any

from kvserve.errors import InvalidRequestError

MAX_JSON_DEPTH = 64
_SURROGATE = re.compile("[\ud800-\udfff]")
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")    # the only way JSON text can spell one


def _reject_constant(name: str):
    raise ValueError(f"{name} is not valid JSON")


def _depth(value: Any, limit: int) -> int:
    """Nesting depth of ``value``; stops counting past ``limit``."""
    stack, deepest = [(value, 1)], 0
    while stack:
        item, depth = stack.pop()
        deepest = max(deepest, depth)
        if depth > limit:
            return depth
        if isinstance(item, dict):
            stack.extend((v, depth + 1) for v in item.values())
        elif isinstance(item, list):
            stack.extend((v, depth + 1) for v in item)
    return deepest


def parse_json_body(body: bytes) -> dict:
    """Decode a request body: UTF-8, strict JSON (no NaN/Infinity), an object, bounded depth."""
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise InvalidRequestError(f"the body is not valid UTF-8: {exc.reason} at byte {exc.start}",
                                  code="invalid_encoding") from exc
    try:
        value = json.loads(text, parse_constant=_reject_constant)
    except RecursionError as exc:
        raise InvalidRequestError("the JSON body is nested too deeply", code="invalid_json") from exc
    except ValueError as exc:
        raise InvalidRequestError(f"the body is not valid JSON: {exc}", code="invalid_json") from exc
    if not isinstance(value, dict):
        raise InvalidRequestError("the JSON body must be an object", code="invalid_json")
    if _depth(value, MAX_JSON_DEPTH) > MAX_JSON_DEPTH:
        raise InvalidRequestError(f"the JSON body is nested deeper than {MAX_JSON_DEPTH}", code="invalid_json")
    if _SURROGATE_ESCAPE.search(text) and _has_lone_surrogate(value):     # the walk only when escaped
        raise InvalidRequestError("the body holds a lone UTF-16 surrogate escape (such as \\ud800), which "
                                  "is not a Unicode character", code="invalid_encoding")
    return value


def _has_lone_surrogate(value: Any) -> bool:
    """True if a string or key anywhere in ``value`` holds an unpaired surrogate (JSON's
    ``\\ud800`` escapes decode to one; no tokenizer or encoder downstream accepts it)."""
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            if _SURROGATE.search(item):
                return True
        elif isinstance(item, dict):
            stack.extend(item.keys())
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
    return False
