"""Tool calls out of generated text, whole or as it streams.

One function, :func:`parse_output`, reads a choice's text so far; the whole response
uses its final reading, and a stream sends, after every delta, what the new reading adds
to what was sent (:class:`ToolCallStream`). Each reading extends the one before (content
and arguments only grow, calls are only appended), so a streamed call assembles to the
call of the whole response.

Two formats (see kvserve/server/tools.py):

- forced (``tool_choice`` "required" or named, output constrained by JSON schema): the
  text is the call's JSON object, or an array of them. A call is reported as soon as its
  name is read, and its ``arguments`` are the text of the arguments value as generated
  (cut short if the output was).
- auto: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` blocks. A call is
  reported once its block is closed (or the output ended); its arguments are re-serialised
  JSON. The content is the text before the first block; text after the blocks is dropped.
  Blocks that are not a call of a known tool are dropped; when no block is, the whole text
  is the content.
"""
from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field

from kvserve.server.tools import ToolConfig

OPEN_TAG, CLOSE_TAG = "<tool_call>", "</tool_call>"
_HEAD = re.compile(r'\{\s*"name"\s*:\s*("(?:[^"\\]|\\.)*")\s*,\s*"arguments"\s*:\s*')
_SCALAR = re.compile(r'-?[0-9][0-9.eE+-]*|true|false|null')


@dataclass
class ParsedCall:
    """One call read from the text: its function name and arguments (JSON text)."""

    name: str
    arguments: str


@dataclass
class ParsedOutput:
    """A reading of a choice's text: the content to show (None: none) and the calls."""

    content: str | None
    calls: list[ParsedCall] = field(default_factory=list)


def new_call_id() -> str:
    """A tool call id (``call_`` and 24 hex digits)."""
    return f"call_{uuid.uuid4().hex[:24]}"


def parse_output(text: str, config: ToolConfig, final: bool) -> ParsedOutput:
    """Read ``text`` (the output so far; ``final``: the whole output)."""
    if config.constrained:
        return _parse_forced(text, config, final)
    return _parse_tagged(text, config, final)


# ------------------------------------------------------------------ forced
def _parse_forced(text: str, config: ToolConfig, final: bool) -> ParsedOutput:
    i = _skip_ws(text, 0)
    if config.array and text.startswith("[", i):
        calls = _call_list(text, i + 1)
    else:                                       # one call object (also read where an array was asked)
        call, _ = _call_at(text, i)
        calls = [call] if call is not None else []
    calls = [c for c in calls if config.tool(c.name) is not None]
    if calls:
        return ParsedOutput(None, calls)
    return ParsedOutput((text or None) if final else None)


def _call_list(text: str, i: int) -> list[ParsedCall]:
    """The calls of a JSON array whose items start at ``i``, the last maybe incomplete."""
    calls = []
    while True:
        call, end = _call_at(text, _skip_ws(text, i))
        if call is None:
            return calls
        calls.append(call)
        if end is None:
            return calls
        i = _skip_ws(text, end)
        if not text.startswith(",", i):
            return calls
        i += 1


def _call_at(text: str, i: int) -> tuple[ParsedCall | None, int | None]:
    """The call object starting at ``i`` (None: none yet) and the index after it (None:
    not complete)."""
    head = _HEAD.match(text, i)
    end = _value_end(text, i)
    if head is None:
        if end is None:
            return None, None
        return _json_call(text[i:end]), end
    name, start = json.loads(head.group(1)), head.end()
    args_end = _value_end(text, start)
    if args_end is None:
        return ParsedCall(name, text[start:]), None
    return ParsedCall(name, text[start:args_end]), end


def _skip_ws(text: str, i: int) -> int:
    while i < len(text) and text[i] in " \t\r\n":
        i += 1
    return i


def _value_end(text: str, i: int) -> int | None:
    """The index just after the JSON value starting at ``i``; None if it is not complete."""
    if i >= len(text):
        return None
    if text[i] not in '{["':
        scalar = _SCALAR.match(text, i)
        return scalar.end() if scalar is not None and scalar.end() < len(text) else None
    depth, in_string, j = 0, False, i
    while j < len(text):
        ch = text[j]
        if in_string:
            if ch == "\\":
                j += 1
            elif ch == '"':
                in_string = False
                if depth == 0:
                    return j + 1
        elif ch == '"':
            in_string = True
        elif ch in "{[":
            depth += 1
        elif ch in "}]":
            depth -= 1
            if depth == 0:
                return j + 1
        j += 1
    return None


# ------------------------------------------------------------------ auto
def _parse_tagged(text: str, config: ToolConfig, final: bool) -> ParsedOutput:
    start = text.find(OPEN_TAG)
    if start < 0:
        return ParsedOutput((text or None) if final else _held_back(text))
    calls, pos = [], start
    while pos >= 0:
        body = pos + len(OPEN_TAG)
        close = text.find(CLOSE_TAG, body)
        if close < 0 and not final:
            break
        call = _json_call(text[body:] if close < 0 else text[body:close])
        if call is not None and config.tool(call.name) is not None:
            calls.append(call)
        if close < 0:
            break
        pos = text.find(OPEN_TAG, close + len(CLOSE_TAG))
    if final and not calls:
        return ParsedOutput(text or None)
    return ParsedOutput(text[:start].rstrip() or None, calls)


def _held_back(text: str) -> str | None:
    """Content that is safe to send: not a possible start of a tag, no trailing space
    (it goes if a tool call follows)."""
    for k in range(len(OPEN_TAG) - 1, 0, -1):
        if text.endswith(OPEN_TAG[:k]):
            text = text[:-k]
            break
    return text.rstrip() or None


def _json_call(body: str) -> ParsedCall | None:
    """``{"name": str, "arguments": object}`` (arguments may be JSON text) -> ParsedCall."""
    try:
        value = json.loads(body)
    except ValueError:
        return None
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    arguments = value.get("arguments", {})
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except ValueError:
            return None
    if not isinstance(arguments, dict):
        return None
    return ParsedCall(value["name"], json.dumps(arguments, ensure_ascii=False))


# ------------------------------------------------------------------ responses
def final_message(config: ToolConfig, text: str, finish_reason: str | None) -> tuple[dict, str | None]:
    """A whole response's ``message`` and ``finish_reason`` ("tool_calls" when it called
    and stopped by itself)."""
    parsed = parse_output(text, config, final=True)
    if not parsed.calls:
        return {"role": "assistant", "content": text}, finish_reason
    calls = [{"id": new_call_id(), "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
             for c in parsed.calls]
    message = {"role": "assistant", "content": parsed.content, "tool_calls": calls}
    return message, "tool_calls" if finish_reason == "stop" else finish_reason


class ToolCallStream:
    """One streamed choice: feed each text delta, get the content and tool-call deltas to
    send (OpenAI's shape: a call's first delta carries index, id, type, name and the
    arguments read so far; then argument fragments)."""

    def __init__(self, config: ToolConfig):
        self.config = config
        self.text = ""
        self._content_sent = 0
        self._calls_sent: list[list] = []        # [id, characters of arguments sent] per call

    @property
    def sent_content(self) -> bool:
        """Whether any content has been sent."""
        return self._content_sent > 0

    @property
    def called(self) -> bool:
        """Whether a tool call has been sent."""
        return bool(self._calls_sent)

    def feed(self, text: str, final: bool) -> tuple[str, list[dict]]:
        """Add ``text``; the new content and the tool-call deltas (``final``: the output ended)."""
        self.text += text
        parsed = parse_output(self.text, self.config, final)
        if final and not parsed.calls:
            parsed.content = self.text
        content = parsed.content or ""
        new_content = content[self._content_sent:]
        self._content_sent = max(self._content_sent, len(content))
        deltas = []
        for index, call in enumerate(parsed.calls):
            if index == len(self._calls_sent):           # a new call: its first delta, once
                self._calls_sent.append([new_call_id(), len(call.arguments)])
                deltas.append({"index": index, "id": self._calls_sent[index][0], "type": "function",
                               "function": {"name": call.name, "arguments": call.arguments}})
                continue
            sent = self._calls_sent[index][1]
            if len(call.arguments) > sent:
                deltas.append({"index": index, "function": {"arguments": call.arguments[sent:]}})
                self._calls_sent[index][1] = len(call.arguments)
        return new_content, deltas

    def finish_reason(self, finish_reason: str | None) -> str | None:
        """The chunk's finish_reason: "tool_calls" when it called and stopped by itself."""
        return "tool_calls" if finish_reason == "stop" and self.called else finish_reason
