"""Tool calling on the HTTP side: the request's ``tools`` / ``tool_choice`` /
``parallel_tool_calls`` checked into a ``ToolConfig``, tool-carrying messages checked,
and the output constraint a forced call runs under.

The formats (see docs/tool_calling.md):

- ``tool_choice`` ``"required"`` or a named function: the output is constrained (a
  ``StructuredSpec`` of kind JSON_SCHEMA) to the raw JSON of the call,
  ``{"name": ..., "arguments": {...}}``, or with ``parallel_tool_calls`` and
  ``"required"`` an array of such calls; the arguments match the tool's schema.
- ``"auto"``: the model writes ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``
  blocks (Hermes style) that kvserve/server/tool_parser.py finds.
- ``"none"`` (or no tools): tools are not shown to the model and nothing is parsed.

Rendering the tools into the prompt is kvserve/server/tool_prompt.py.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from kvserve.engine.structured_spec import StructuredKind, StructuredSpec
from kvserve.errors import InvalidRequestError
from kvserve.server.response_format import STRUCTURED_FIELDS

MAX_TOOLS = 128
MAX_DESCRIPTION_CHARS = 8192
MAX_PARALLEL_CALLS = 4      # most calls of a forced parallel answer: a small model repeats calls until cut off
_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")       # OpenAI's rule for function names
CHOICES = ("none", "auto", "required")


@dataclass(frozen=True)
class Tool:
    """One function the model may call: its name, description and parameters' JSON schema."""

    name: str
    description: str | None
    parameters: dict

    def as_openai(self) -> dict:
        """The tool as the request spelled it (``{"type": "function", "function": {...}}``)."""
        function: dict[str, Any] = {"name": self.name}
        if self.description is not None:
            function["description"] = self.description
        function["parameters"] = self.parameters
        return {"type": "function", "function": function}


@dataclass(frozen=True)
class ToolConfig:
    """A chat request's tool settings. ``choice``: "auto", "required" or "function" (then
    ``function`` names the forced tool); ``parallel``: more than one call allowed."""

    tools: tuple[Tool, ...]
    choice: str
    function: str | None = None
    parallel: bool = True

    @property
    def constrained(self) -> bool:
        """Whether the output is forced to be a call (JSON-schema constrained)."""
        return self.choice in ("required", "function")

    @property
    def array(self) -> bool:
        """Whether the constrained output is a JSON array of calls (else one call object)."""
        return self.choice == "required" and self.parallel

    def tool(self, name: str) -> Tool | None:
        """The tool called ``name`` (None: not one of this request's tools)."""
        return next((t for t in self.tools if t.name == name), None)


def _bad(param: str, message: str) -> InvalidRequestError:
    return InvalidRequestError(message, param=param)


# ----------------------------------------------------------------- fields
def check_tools(name: str, value: Any) -> tuple[Tool, ...] | None:
    """The ``tools`` field -> Tools (None when absent or empty); a 400 names the bad part."""
    if value is None or value == []:
        return None
    if not isinstance(value, list):
        raise _bad(name, f"{name} must be a list of tool objects")
    if len(value) > MAX_TOOLS:
        raise _bad(name, f"{name} accepts at most {MAX_TOOLS} tools, got {len(value)}")
    tools, seen = [], set()
    for i, item in enumerate(value):
        where = f"{name}[{i}]"
        if not isinstance(item, dict) or set(item) - {"type", "function"}:
            raise _bad(where, f"{where} must be an object with the keys type and function")
        if item.get("type") != "function":
            raise _bad(f"{where}.type", f'{where}.type must be "function"')
        tool = _function(f"{where}.function", item.get("function"))
        if tool.name in seen:
            raise _bad(f"{where}.function.name", f"{where}.function.name {tool.name!r} is used by another tool")
        seen.add(tool.name)
        tools.append(tool)
    return tuple(tools)


def _function(where: str, value: Any) -> Tool:
    if not isinstance(value, dict):
        raise _bad(where, f"{where} must be an object")
    unknown = sorted(set(value) - {"name", "description", "parameters", "strict"})
    if unknown:
        raise _bad(f"{where}.{unknown[0]}", f"{where}.{unknown[0]} is not a known field")
    name = value.get("name")
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise _bad(f"{where}.name", f"{where}.name must be 1 to 64 letters, digits, '_' or '-', got {name!r}")
    description = value.get("description")
    if description is not None and (not isinstance(description, str) or len(description) > MAX_DESCRIPTION_CHARS):
        raise _bad(f"{where}.description", f"{where}.description must be a string of at most "
                                           f"{MAX_DESCRIPTION_CHARS} characters")
    if value.get("strict") is not None and not isinstance(value["strict"], bool):
        raise _bad(f"{where}.strict", f"{where}.strict must be a boolean")
    parameters = value.get("parameters")
    if parameters is None:
        parameters = {"type": "object", "properties": {}}
    if not isinstance(parameters, dict):
        raise _bad(f"{where}.parameters", f"{where}.parameters must be a JSON schema object")
    if parameters.get("type", "object") != "object":
        raise _bad(f"{where}.parameters", f'{where}.parameters must describe an object ("type": "object")')
    return Tool(name, description, parameters)


def check_tool_choice(name: str, value: Any) -> str | dict | None:
    """The ``tool_choice`` field: "none", "auto", "required" or ``{"type": "function",
    "function": {"name": ...}}`` (that it names a tool is checked by :func:`tool_config`)."""
    if value is None or value in CHOICES:
        return value
    if isinstance(value, dict) and value.get("type") == "function" and set(value) == {"type", "function"}:
        function = value["function"]
        if isinstance(function, dict) and set(function) == {"name"} and isinstance(function["name"], str):
            return {"name": function["name"]}
        raise _bad(f"{name}.function", f"{name}.function must be an object with the only key name")
    raise _bad(name, f'{name} must be "none", "auto", "required" or {{"type": "function", '
                     f'"function": {{"name": ...}}}}, got {value!r}'[:200])


def tool_config(values: dict) -> ToolConfig | None:
    """The request's ToolConfig from its checked fields (None: no tool calling). Without
    tools, a tool_choice other than "none" is a 400; a named choice must name a tool."""
    tools, choice = values.get("tools"), values.get("tool_choice")
    parallel = values.get("parallel_tool_calls") is not False
    if not tools:
        if choice not in (None, "none"):
            raise _bad("tool_choice", "tool_choice needs tools: the request lists none")
        return None
    if choice == "none":
        return None
    if isinstance(choice, dict):
        if not any(t.name == choice["name"] for t in tools):
            raise _bad("tool_choice.function.name",
                       f"tool_choice.function.name {choice['name']!r} is not one of the request's tools")
        config = ToolConfig(tools, "function", choice["name"], parallel)
    else:
        config = ToolConfig(tools, choice or "auto", None, parallel)
    asked = [name for name in STRUCTURED_FIELDS if values.get(name) is not None]
    if config.constrained and asked:
        raise _bad(asked[0], f"{asked[0]} cannot be combined with a forced tool call (tool_choice "
                             '"required" or a named function): both constrain the output')
    return config


# ----------------------------------------------------------------- messages
def check_tool_messages(messages: Any) -> None:
    """The tool parts of chat messages: an assistant's ``tool_calls`` (ids, function names,
    arguments as JSON text) and a ``tool`` message's ``tool_call_id``. Other checks are the
    chat template renderer's (kvserve/tokenizer/chat_template.py)."""
    if not isinstance(messages, list):
        return
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            continue
        where = f"messages[{i}]"
        if message.get("role") == "tool":
            if not isinstance(message.get("tool_call_id"), str) or not message["tool_call_id"]:
                raise _bad(f"{where}.tool_call_id", f"{where}.tool_call_id is required for a tool message")
        elif message.get("tool_calls") is not None:
            if message.get("role") != "assistant":
                raise _bad(f"{where}.tool_calls", f"{where}.tool_calls is only allowed in assistant messages")
            _check_calls(f"{where}.tool_calls", message["tool_calls"])


def _check_calls(where: str, calls: Any) -> None:
    if not isinstance(calls, list):
        raise _bad(where, f"{where} must be a list of tool calls")
    for j, call in enumerate(calls):
        at = f"{where}[{j}]"
        if not isinstance(call, dict) or call.get("type", "function") != "function":
            raise _bad(at, f'{at} must be an object of type "function"')
        if not isinstance(call.get("id"), str) or not call["id"]:
            raise _bad(f"{at}.id", f"{at}.id must be a non-empty string")
        function = call.get("function")
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise _bad(f"{at}.function.name", f"{at}.function.name must be a string")
        arguments = function.get("arguments")
        if not isinstance(arguments, str):
            raise _bad(f"{at}.function.arguments", f"{at}.function.arguments must be a JSON string")
        try:
            json.loads(arguments)
        except ValueError as exc:
            raise _bad(f"{at}.function.arguments", f"{at}.function.arguments is not valid JSON: {exc}") from exc


# ----------------------------------------------------------------- constraint
def call_schema(tool: Tool) -> dict:
    """The JSON schema of one call of ``tool``: ``{"name": <its name>, "arguments": <its
    parameters>}``, name first, nothing else."""
    return {"type": "object",
            "properties": {"name": {"type": "string", "enum": [tool.name]}, "arguments": tool.parameters},
            "required": ["name", "arguments"], "additionalProperties": False}


def output_schema(config: ToolConfig) -> dict:
    """The JSON schema a forced call's output matches: the named tool's call; with
    "required" any tool's call, or an array of 1 to MAX_PARALLEL_CALLS of them when calls
    may be parallel."""
    if config.choice == "function":
        return call_schema(config.tool(config.function))
    calls = [call_schema(t) for t in config.tools]
    one = calls[0] if len(calls) == 1 else {"anyOf": calls}
    return {"type": "array", "items": one, "minItems": 1, "maxItems": MAX_PARALLEL_CALLS} if config.array else one


def output_constraint(config: ToolConfig | None) -> StructuredSpec | None:
    """The StructuredSpec the engine decodes a forced call under (None: unconstrained)."""
    if config is None or not config.constrained:
        return None
    return StructuredSpec(StructuredKind.JSON_SCHEMA, json.dumps(output_schema(config), ensure_ascii=False))


# The JSON Schemas of what the checkers accept (/openapi.json describes the fields with them).
_FUNCTION_SCHEMA = {"type": "object", "required": ["name"], "additionalProperties": False,
                    "properties": {"name": {"type": "string", "pattern": "^[A-Za-z0-9_-]{1,64}$"},
                                   "description": {"type": "string", "maxLength": MAX_DESCRIPTION_CHARS},
                                   "parameters": {"type": "object"}, "strict": {"type": "boolean"}}}
check_tools.schema = {"anyOf": [{"type": "array", "maxItems": MAX_TOOLS, "items": {
    "type": "object", "required": ["type", "function"], "additionalProperties": False,
    "properties": {"type": {"enum": ["function"]}, "function": _FUNCTION_SCHEMA}}}, {"type": "null"}]}
check_tool_choice.schema = {"anyOf": [{"enum": [*CHOICES, None]}, {
    "type": "object", "required": ["type", "function"], "additionalProperties": False,
    "properties": {"type": {"enum": ["function"]}, "function": {
        "type": "object", "required": ["name"], "additionalProperties": False,
        "properties": {"name": {"type": "string"}}}}}]}
