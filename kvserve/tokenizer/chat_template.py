"""Chat templates: validate messages and render them in a Jinja sandbox.

Rendering follows Hugging Face's ``apply_chat_template``: an
``ImmutableSandboxedEnvironment`` with ``trim_blocks`` and ``lstrip_blocks``, the
``loopcontrols`` extension, a no-op ``{% generation %}`` block, the helpers
``raise_exception``, ``strftime_now`` and a ``tojson`` filter that keeps
non-ASCII text, and the variables ``messages``, ``add_generation_prompt``,
``tools``, ``documents``, ``bos_token``, ``eos_token`` plus any extra keyword.

The sandbox refuses access to private attributes (``__class__``, ``__mro__``...)
and any mutation of the values passed in; such a template fails with an error
instead of reaching Python internals.

When a checkpoint has no template, ``FALLBACK_TEMPLATE`` is used: one
``"{role}: {content}\\n"`` line per message, then ``"assistant:"`` when a
generation prompt is asked for.
"""
from __future__ import annotations

import json
from datetime import datetime
from functools import lru_cache

import jinja2
from jinja2 import meta, nodes
from jinja2.ext import Extension
from jinja2.sandbox import ImmutableSandboxedEnvironment

from kvserve.errors import InvalidRequestError, KVServeError

FALLBACK_TEMPLATE = (
    "{% for message in messages %}{{ message['role'] + ': ' + message['content'] + '\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ 'assistant:' }}{% endif %}"
)

_MAX_COMPILED = 8
_OPTIONAL_STR_KEYS = ("name", "tool_call_id", "reasoning_content")


class _GenerationBlock(Extension):
    """``{% generation %}...{% endgeneration %}`` (HF's assistant mask marker) renders its body."""

    tags = {"generation"}

    def parse(self, parser):
        """Parse the block and return its body unchanged."""
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.Scope(body, lineno=lineno)


def _raise_exception(message):
    raise jinja2.exceptions.TemplateError(message)


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def _strftime_now(fmt):
    return datetime.now().strftime(fmt)


def _content_text(content, index: int):
    """A message's content as the template sees it: str, or None for tool-call turns."""
    if content is None or isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise InvalidRequestError(
                    f"messages[{index}].content: only text parts ({{'type': 'text', 'text': str}}) are supported",
                    param="messages")
            texts.append(part["text"])
        return "\n".join(texts)
    raise InvalidRequestError(f"messages[{index}].content must be a string or a list of text parts",
                              param="messages")


def validate_messages(messages) -> list[dict]:
    """Check `messages` and return copies the template can render.

    Each message must be a dict with a string ``role`` and a ``content`` that is a
    string or a list of text parts (joined with newlines); ``content`` may be None
    only for an assistant turn carrying ``tool_calls``. Other keys pass through.
    Raises InvalidRequestError(param="messages") otherwise.
    """
    if not isinstance(messages, (list, tuple)) or not messages:
        raise InvalidRequestError("messages must be a non-empty list of message objects", param="messages")
    checked = []
    for index, message in enumerate(messages):
        if not isinstance(message, dict):
            raise InvalidRequestError(f"messages[{index}] must be an object", param="messages")
        role = message.get("role")
        if not isinstance(role, str) or not role:
            raise InvalidRequestError(f"messages[{index}].role must be a non-empty string", param="messages")
        content = _content_text(message.get("content"), index)
        if content is None and not message.get("tool_calls"):
            raise InvalidRequestError(f"messages[{index}].content is required", param="messages")
        for key in _OPTIONAL_STR_KEYS:
            if message.get(key) is not None and not isinstance(message[key], str):
                raise InvalidRequestError(f"messages[{index}].{key} must be a string", param="messages")
        checked.append({**message, "content": content})
    return checked


@lru_cache(maxsize=_MAX_COMPILED)
def template_variables(template: str) -> frozenset[str]:
    """The variables ``template`` reads from its context (``messages``, ``tools``...), from
    its syntax tree: a template that declares tool support reads ``tools``. A template
    that does not parse reads nothing (rendering it reports the error)."""
    env = jinja2.Environment(extensions=["jinja2.ext.loopcontrols", _GenerationBlock])
    try:
        return frozenset(meta.find_undeclared_variables(env.parse(template)))
    except jinja2.exceptions.TemplateSyntaxError:
        return frozenset()


class ChatTemplateRenderer:
    """Compiles chat templates once per renderer and renders them in a sandbox."""

    def __init__(self):
        """Create the sandboxed environment (one per tokenizer, no shared state)."""
        self._env = ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols", _GenerationBlock])
        self._env.filters["tojson"] = _tojson
        self._env.globals["raise_exception"] = _raise_exception
        self._env.globals["strftime_now"] = _strftime_now
        self._compiled: dict[str, jinja2.Template] = {}

    def render(self, template: str, messages, *, add_generation_prompt: bool, from_request: bool,
               variables: dict) -> str:
        """Render `template` for validated `messages`.

        A failure the conversation causes (``raise_exception``, a bad value) is an
        InvalidRequestError on ``messages``. A template that does not compile or
        breaks the sandbox is an InvalidRequestError on ``chat_template`` when the
        request supplied it (`from_request`), else a KVServeError (server side).
        """
        checked = validate_messages(messages)
        context = {"tools": None, "documents": None, **variables,
                   "messages": checked, "add_generation_prompt": add_generation_prompt}
        try:
            compiled = self._compile(template)
            return compiled.render(**context)
        except jinja2.exceptions.SecurityError as exc:
            raise self._template_fault(f"chat template refused by the sandbox: {exc}", from_request) from exc
        except jinja2.exceptions.TemplateSyntaxError as exc:
            raise self._template_fault(f"chat template does not compile: {exc}", from_request) from exc
        except (jinja2.exceptions.TemplateError, TypeError, ValueError, KeyError, IndexError,
                AttributeError) as exc:
            raise InvalidRequestError(f"cannot apply the chat template to these messages: {exc}",
                                      param="messages") from exc

    def _compile(self, template: str) -> jinja2.Template:
        compiled = self._compiled.get(template)
        if compiled is None:
            compiled = self._env.from_string(template)
            if len(self._compiled) >= _MAX_COMPILED:  # request-supplied templates: stay bounded
                self._compiled.pop(next(iter(self._compiled)))
            self._compiled[template] = compiled
        return compiled

    @staticmethod
    def _template_fault(message: str, from_request: bool) -> KVServeError:
        if from_request:
            return InvalidRequestError(message, param="chat_template", code="invalid_chat_template")
        return KVServeError(message, code="chat_template_error")
