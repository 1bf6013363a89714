"""``/openapi.json``: the OpenAPI 3.1 document of the server's routes.

The request bodies are derived from the field tables of ``protocol.py``: every checker
carries ``schema``, the JSON Schema of the values it accepts, so the document and the
validation cannot drift apart (``tests/unit/test_conformance.py`` checks that they
agree, value by value). A field whose checker publishes no schema is described as "any
value, checked by the server". Routes and their summaries come from the FastAPI app;
errors share OpenAI's shape; every route but ``/health`` and ``/ready`` needs the bearer
key when keys are configured.
"""
from __future__ import annotations

import re
import warnings
from typing import Callable

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi

from kvserve.server import protocol
from kvserve.server.auth import PUBLIC_PATHS

UNDESCRIBED = {"description": "any JSON value; checked by the server (no schema published)"}
ERROR_SCHEMA = {
    "type": "object", "required": ["error"],
    "properties": {"error": {
        "type": "object", "required": ["message", "type", "param", "code"],
        "properties": {"message": {"type": "string"}, "type": {"type": "string"},
                       "param": {"type": ["string", "null"]}, "code": {"type": ["string", "null"]}}}},
}
ERROR_STATUSES = {"400": "invalid request (the field is named in error.param)", "401": "no or unknown API key",
                  "403": "the key may not use this route or model", "404": "unknown route or model",
                  "413": "body too large", "415": "not application/json", "429": "rate limited",
                  "503": "not ready, draining, or queue full"}


def field_schema(check: Callable) -> dict:
    """The JSON Schema a field's checker accepts (``UNDESCRIBED`` when it publishes none)."""
    return getattr(check, "schema", None) or UNDESCRIBED


def body_schema(table: dict[str, Callable], required: tuple[str, ...] = ()) -> dict:
    """A request body of ``table``'s fields: unknown fields are refused, as ``check_fields`` does."""
    schema = {"type": "object", "properties": {name: field_schema(check) for name, check in table.items()},
              "additionalProperties": False}
    if required:
        schema["required"] = list(required)
    return schema


def tokenize_schema() -> dict:
    """/tokenize: exactly one of a string ``prompt`` or a ``messages`` list (null counts as absent)."""
    schema = body_schema(protocol.TOKENIZE_FIELDS)
    schema["oneOf"] = [{"required": ["prompt"], "properties": {"prompt": {"type": "string"}}},
                       {"required": ["messages"], "properties": {"messages": {"type": "array"}}}]
    return schema


def request_bodies() -> dict[str, dict]:
    """path -> the JSON Schema of its POST body, from protocol.py's tables."""
    return {
        "/v1/completions": body_schema(protocol.COMPLETION_FIELDS, ("prompt",)),
        "/v1/chat/completions": body_schema(protocol.CHAT_FIELDS, ("messages",)),
        "/tokenize": tokenize_schema(),
        "/detokenize": body_schema(protocol.DETOKENIZE_FIELDS, ("tokens",)),
    }


def build_document(app: FastAPI) -> dict:
    """The OpenAPI document of ``app``'s routes with the request bodies of ``request_bodies``."""
    with warnings.catch_warnings():       # GET + HEAD routes share FastAPI's id: replaced below
        warnings.filterwarnings("ignore", message="Duplicate Operation ID")
        doc = get_openapi(title=app.title, version=app.version, routes=app.routes,
                          description="kvserve's OpenAI-compatible API; request bodies as the server validates them")
    components = doc.setdefault("components", {})
    components.setdefault("schemas", {})["Error"] = ERROR_SCHEMA
    components["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer"}}
    doc["security"] = [{"bearer": []}]
    bodies = request_bodies()
    error_ref = {"content": {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}}}
    for path, operations in doc.get("paths", {}).items():
        for method, operation in operations.items():
            operation["operationId"] = method + "_" + "_".join(re.findall(r"[A-Za-z0-9]+", path))
            operation["responses"].pop("422", None)             # FastAPI's own validation is not used
            for status, reason in ERROR_STATUSES.items():
                operation["responses"].setdefault(status, {"description": reason, **error_ref})
            if path in PUBLIC_PATHS:
                operation["security"] = []
            if method == "post" and path in bodies:
                operation["requestBody"] = {"required": True,
                                            "content": {"application/json": {"schema": bodies[path]}}}
    return doc
