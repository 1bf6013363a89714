"""Tools and tool turns into the chat prompt.

A chat template that reads ``tools`` (it declares tool support) gets the tools as
``tools=[{"type": "function", "function": {...}}]`` and the messages as sent (tool-call
arguments parsed into objects, as Hugging Face templates expect). Any other template
(SmolLM2's among them) gets the default rendering, in plain messages it can show:

- a system block (``TOOLS_HEADER``) listing each tool's JSON schema inside
  ``<tools></tools>`` and the call format, appended to the first system message (or
  a new system message first);
- an assistant turn's ``tool_calls`` as ``<tool_call>{"name": ..., "arguments": ...}</tool_call>``
  lines after its content;
- ``tool`` messages as a user turn holding ``<tool_response>...</tool_response>``
  blocks (consecutive results in one turn).
"""
from __future__ import annotations

import json

from kvserve.server.tools import ToolConfig
from kvserve.tokenizer.chat_template import FALLBACK_TEMPLATE, template_variables

TOOLS_HEADER = (
    "# Tools\n\n"
    "You can call the functions listed inside <tools></tools>, each given with a JSON schema of its "
    "arguments:\n<tools>\n{tools}\n</tools>\n\n"
    "To call a function, write its name and arguments as a JSON object inside <tool_call></tool_call> tags:\n"
    "<tool_call>\n{{\"name\": \"<function name>\", \"arguments\": <arguments object>}}\n</tool_call>\n"
    "Results come back inside <tool_response></tool_response> tags."
)
FORCED_ONE = "\n\nCall the function {name} now: answer with the call's JSON object only."
FORCED_ANY = "\n\nCall one of the functions now: answer with the call's JSON object only."
FORCED_ARRAY = "\n\nCall the functions now: answer with a JSON array of call objects only."


def template_declares_tools(template: str | None) -> bool:
    """Whether the chat template reads the ``tools`` variable."""
    return "tools" in template_variables(template or FALLBACK_TEMPLATE)


def render_chat_prompt(tokenizer, messages: list, config: ToolConfig | None) -> str:
    """The prompt text of a chat request with its tools (``config`` None: no tools shown)."""
    if template_declares_tools(tokenizer.chat_template):
        tools = [t.as_openai() for t in config.tools] if config is not None else None
        return tokenizer.apply_chat_template(_with_parsed_arguments(messages), add_generation_prompt=True,
                                             tools=tools)
    return tokenizer.apply_chat_template(default_messages(messages, config), add_generation_prompt=True)


def tools_block(config: ToolConfig) -> str:
    """The default system block: the tools' schemas, the call format, and for a forced call
    what to answer."""
    listed = "\n".join(json.dumps(t.as_openai(), ensure_ascii=False) for t in config.tools)
    block = TOOLS_HEADER.format(tools=listed)
    if config.choice == "function":
        block += FORCED_ONE.format(name=config.function)
    elif config.constrained:
        block += FORCED_ARRAY if config.array else FORCED_ANY
    return block


def default_messages(messages: list, config: ToolConfig | None) -> list:
    """Messages with the tools and tool turns spelled as text (the default rendering).
    Messages it cannot read are passed on unchanged for the renderer to refuse."""
    out: list = []
    for message in messages:
        if not isinstance(message, dict):
            out.append(message)
        elif message.get("role") == "tool":
            block = f"<tool_response>\n{_text(message.get('content'))}\n</tool_response>"
            if out and isinstance(out[-1], dict) and out[-1].get("_tool_results"):
                out[-1]["content"] += "\n" + block
            else:
                out.append({"role": "user", "content": block, "_tool_results": True})
        elif message.get("role") == "assistant" and message.get("tool_calls"):
            out.append(_assistant_calls(message))
        else:
            out.append(message)
    out = [{k: v for k, v in m.items() if k != "_tool_results"} if isinstance(m, dict) else m for m in out]
    if config is None:
        return out
    block = tools_block(config)
    first = out[0] if out else None
    if isinstance(first, dict) and first.get("role") in ("system", "developer") and isinstance(
            first.get("content"), str):
        return [{**first, "content": first["content"] + "\n\n" + block}] + out[1:]
    return [{"role": "system", "content": block}] + out


def _assistant_calls(message: dict) -> dict:
    lines = []
    for call in message["tool_calls"]:
        function = call["function"]
        arguments = json.loads(function["arguments"])
        lines.append("<tool_call>\n" + json.dumps({"name": function["name"], "arguments": arguments},
                                                  ensure_ascii=False) + "\n</tool_call>")
    content = _text(message.get("content"))
    text = "\n".join(([content] if content else []) + lines)
    return {k: v for k, v in message.items() if k != "tool_calls"} | {"content": text}


def _text(content) -> str:
    """A message's content as text (text parts joined by newlines; None is empty)."""
    if content is None:
        return ""
    if isinstance(content, list):
        return "\n".join(p.get("text", "") for p in content if isinstance(p, dict))
    return str(content)


def _with_parsed_arguments(messages: list) -> list:
    """Tool calls' ``arguments`` as objects (HF templates render them with ``tojson``)."""
    out = []
    for message in messages:
        if isinstance(message, dict) and message.get("tool_calls"):
            calls = [{**c, "function": {**c["function"], "arguments": json.loads(c["function"]["arguments"])}}
                     for c in message["tool_calls"]]
            message = {**message, "tool_calls": calls}
        out.append(message)
    return out
