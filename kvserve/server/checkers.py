"""Field checkers' building blocks and the message / client-field checkers of the OpenAI API.

A checker is ``check(name, value) -> normalised value`` and raises InvalidRequestError
naming the field. ``described(schema)`` attaches the JSON Schema of the values it
accepts: ``server/openapi.py`` publishes it, ``tests/unit/test_conformance.py`` checks
that schema and checker agree. ``protocol.py`` holds the tables that use them.
"""
from __future__ import annotations

from typing import Any, Callable

from kvserve.errors import InvalidRequestError

MESSAGE_ROLES = ("system", "developer", "user", "assistant", "tool")
MAX_METADATA_PAIRS, MAX_METADATA_KEY_CHARS, MAX_METADATA_VALUE_CHARS = 16, 64, 512   # OpenAI's metadata bounds


def bad(param: str, message: str) -> InvalidRequestError:
    """The 400 for field ``param``."""
    return InvalidRequestError(message, param=param)


def show(value: Any) -> str:
    """A value as an error message quotes it (at most 40 characters)."""
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def described(schema: dict) -> Callable[[Callable], Callable]:
    """Attach ``schema`` (the JSON Schema of what the checker accepts) to a checker."""
    def mark(check: Callable) -> Callable:
        check.schema = schema
        return check
    return mark


def nullable(schema: dict) -> dict:
    """``schema`` or null."""
    return {"anyOf": [schema, {"type": "null"}]}


@described(nullable({"type": "object", "maxProperties": MAX_METADATA_PAIRS,
                     "propertyNames": {"maxLength": MAX_METADATA_KEY_CHARS},
                     "additionalProperties": {"type": "string", "maxLength": MAX_METADATA_VALUE_CHARS}}))
def check_metadata(name: str, value: Any) -> Any:
    """OpenAI's metadata: at most 16 string pairs; accepted and dropped (nothing is stored)."""
    if value is None:
        return None
    if (not isinstance(value, dict) or len(value) > MAX_METADATA_PAIRS
            or not all(isinstance(v, str) and len(k) <= MAX_METADATA_KEY_CHARS and len(v) <= MAX_METADATA_VALUE_CHARS
                       for k, v in value.items())):
        raise bad(name, f"{name} must be an object of at most {MAX_METADATA_PAIRS} string pairs (keys of at most "
                        f"{MAX_METADATA_KEY_CHARS} characters, values of at most {MAX_METADATA_VALUE_CHARS})")
    return None


@described({"enum": [False, None]})
def check_store(name: str, value: Any) -> Any:
    """store: false (or null) is accepted; true asks for stored completions, which this server has not."""
    if value is not None and value is not False:
        raise bad(name, f"{name} must be false or null: this server stores no completions, got {show(value)}")
    return None


MESSAGE_SCHEMA = {
    "type": "object", "required": ["role"],
    "properties": {"role": {"enum": list(MESSAGE_ROLES)},
                   "content": {"description": "a string, a list of text parts, or null on an assistant turn with "
                                              "tool_calls; checked when the chat template renders the messages"}},
}


@described({"type": "array", "minItems": 1, "items": MESSAGE_SCHEMA})
def check_messages(name: str, value: Any) -> Any:
    """A non-empty list of message objects with a known role (content is checked when the chat
    template renders them). ``developer`` messages become ``system`` ones: the template's system
    role renders them (OpenAI's newer name for the same instruction turn)."""
    if not isinstance(value, list) or not value:
        raise bad(name, f"{name} must be a non-empty list of message objects")
    messages = []
    for index, message in enumerate(value):
        if not isinstance(message, dict):
            raise bad(f"{name}[{index}]", f"{name}[{index}] must be an object")
        role = message.get("role")
        if role not in MESSAGE_ROLES:
            known = ", ".join(MESSAGE_ROLES)
            raise bad(f"{name}[{index}].role", f"{name}[{index}].role must be one of {known}, got {show(role)}")
        messages.append({**message, "role": "system"} if role == "developer" else message)
    return messages
