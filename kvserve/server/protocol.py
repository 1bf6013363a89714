"""OpenAI request bodies -> validated GenerateSpecs (no tokenizer, no engine).

Every field the API accepts is listed in a table below with its checker: a field
is either honoured (mapped onto SamplingParams or the response format) or
rejected with a 400 naming it. Unknown fields are rejected too, so nothing is
silently ignored. Values are checked for type and range here (bools are not
numbers, NaN and infinities are refused, integers must fit in 64 bits);
SamplingParams.validate then applies the sampling rules.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Any, Callable

from kvserve.engine.service_class import SERVICE_TIERS, ServiceClass, class_for_tier
from kvserve.errors import InvalidRequestError
from kvserve.server.checkers import check_messages, check_metadata, check_store
from kvserve.server.checkers import bad as _bad
from kvserve.server.checkers import described as _described
from kvserve.server.checkers import nullable as _nullable
from kvserve.server.checkers import show as _show
from kvserve.sampling.params import MAX_ABS_LOGIT_BIAS, MAX_LOGIT_BIAS, MAX_LOGPROBS, SamplingParams
from kvserve.engine.structured_spec import StructuredSpec
from kvserve.server.response_format import guided_checker, response_format_spec, structured_from, structured_outputs_spec
from kvserve.server.tools import (ToolConfig, check_tool_choice, check_tool_messages, check_tools, output_constraint,
                                  tool_config)

INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
MAX_PROMPTS = 32            # prompts in one completions request
MAX_CHOICES = 64            # prompts x n
MAX_USER_CHARS = 256
MAX_DEADLINE_S = 3600.0
MAX_PRIORITY = 1_000_000
COMPLETION_DEFAULT_MAX_TOKENS = 16   # OpenAI's length for a completions request that names none
TOKEN_ID_KEY_PATTERN = "^(0|[1-9][0-9]{0,17})$"      # a logit_bias key: a token id in decimal (< 10**18)
_TOKEN_ID_KEY = re.compile(TOKEN_ID_KEY_PATTERN)


@dataclass
class Prompt:
    """One prompt: text (None when given as token ids) or token ids (None when text)."""

    text: str | None = None
    token_ids: list[int] | None = None


@dataclass
class GenerateSpec:
    """A validated completions or chat request, before tokenisation."""

    kind: str                                   # "completion" | "chat"
    model: str | None
    params: SamplingParams
    prompts: list[Prompt] = field(default_factory=list)     # completions
    messages: list[dict] | None = None                       # chat
    max_tokens_param: str = "max_tokens"        # the field that set params.max_tokens
    stream: bool = False
    include_usage: bool = False
    echo: bool = False
    suffix: str | None = None                   # completions: fill in the middle (text prompts only)
    logprobs: int | None = None                 # completions: top-k; chat: top_logprobs when logprobs
    user: str | None = None
    implicit_max_tokens: int | None = None      # completions without max_tokens: OpenAI's default (16), within the
                                                # server's caps (serving.apply_generation_length)
    safety_identifier: str | None = None        # OpenAI's successor of user: an end-user id, logged like it
    prompt_cache_key: str | None = None         # the caller's prefix-cache session key (a routing hint; the
                                                # cache namespace stays the tenant's salt, see server/auth.py)
    deadline_s: float | None = None
    priority: int = 0
    use_prefix_cache: bool = True               # vLLM-style extension: false opts out of the prefix cache
    return_token_ids: bool = False              # vLLM's extension: bodies carry prompt_token_ids and token_ids
    num_speculative_tokens: int | None = None   # extension: most drafts per step (0 = off; None = server's)
    service_class: ServiceClass | None = None   # asked for with service_tier; None = not asked (key's pin or chat)
    tools: ToolConfig | None = None             # chat: tool calling (None: none; see server/tools.py)
    structured: StructuredSpec | None = None    # the output constraint (response_format, guided_*; see
                                                # server/response_format.py); a forced tool call sets its own

    def __post_init__(self):
        """A forced tool call (tool_choice "required" or named) is decoded under its JSON schema."""
        if self.tools is not None and self.tools.constrained:
            self.structured = output_constraint(self.tools)


# -------------------------------------------------------------------- checkers
# Every checker carries ``schema``: the JSON Schema of the values it accepts, from which
# server/openapi.py builds /openapi.json (tests/unit/test_conformance.py checks they agree).
TOKEN_ID_SCHEMA = {"type": "integer", "minimum": 0, "maximum": INT64_MAX}


def _is_token_id(value: Any) -> bool:
    """A non-negative 64-bit integer (an integral float counts, as JSON does not tell them apart)."""
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= INT64_MAX


def _int(lo: int = INT64_MIN, hi: int = INT64_MAX, nullable: bool = True) -> Callable:
    def check(name: str, value: Any) -> Any:
        if value is None and nullable:
            return None
        if isinstance(value, float) and value.is_integer() and lo <= value <= hi:
            value = int(value)
        if not isinstance(value, int) or isinstance(value, bool) or not lo <= value <= hi:
            raise _bad(name, f"{name} must be an integer in [{lo}, {hi}], got {_show(value)}")
        return value
    schema = {"type": "integer", "minimum": lo, "maximum": hi}
    return _described(_nullable(schema) if nullable else schema)(check)


def _number(lo: float = -math.inf, hi: float = math.inf, open_lo: bool = False) -> Callable:
    def check(name: str, value: Any) -> Any:
        if value is None:
            return None
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        if ok:
            ok = math.isfinite(value) and (value > lo if open_lo else value >= lo) and value <= hi
        if not ok:
            bracket = "(" if open_lo else "["
            raise _bad(name, f"{name} must be a number in {bracket}{lo:g}, {hi:g}], got {_show(value)}")
        return float(value) if isinstance(value, float) else value
    schema: dict = {"type": "number"}
    if math.isfinite(lo):
        schema["exclusiveMinimum" if open_lo else "minimum"] = lo
    if math.isfinite(hi):
        schema["maximum"] = hi
    return _described(_nullable(schema))(check)


@_described(_nullable({"type": "boolean"}))
def _bool(name: str, value: Any) -> Any:
    if value is not None and not isinstance(value, bool):
        raise _bad(name, f"{name} must be a boolean, got {_show(value)}")
    return value


def _string(max_chars: int) -> Callable:
    def check(name: str, value: Any) -> Any:
        if value is not None and (not isinstance(value, str) or len(value) > max_chars):
            raise _bad(name, f"{name} must be a string of at most {max_chars} characters")
        return value
    return _described(_nullable({"type": "string", "maxLength": max_chars}))(check)


@_described({"anyOf": [{"type": "string"}, {"type": "array", "items": {"type": "string"}}, {"type": "null"}]})
def _stop(name: str, value: Any) -> Any:
    if value is None or isinstance(value, str):
        return None if value is None or value == "" else [value]
    if isinstance(value, list) and all(isinstance(s, str) for s in value):
        return value
    raise _bad(name, "stop must be a string, a list of strings or null")


@_described(_nullable({"type": "array", "items": TOKEN_ID_SCHEMA}))
def _token_list(name: str, value: Any) -> Any:
    if value is None:
        return None
    if not isinstance(value, list) or not all(_is_token_id(t) for t in value):
        raise _bad(name, f"{name} must be a list of non-negative integers")
    return [int(t) for t in value]


def _only_null(what: str) -> Callable:
    def check(name: str, value: Any) -> Any:
        if value is not None:
            raise _bad(name, f"{name} is not supported by this server ({what})")
        return None
    return _described({"type": "null"})(check)


@_described({"enum": [*sorted(SERVICE_TIERS), None]})
def _service_tier(name: str, value: Any) -> Any:
    """OpenAI's service_tier -> the ServiceClass it names (null: not asked)."""
    if value is None:
        return None
    if not isinstance(value, str) or value not in SERVICE_TIERS:
        accepted = ", ".join(f'"{tier}"' for tier in sorted(SERVICE_TIERS))
        raise _bad(name, f"{name} must be one of {accepted} or null, got {_show(value)}")
    return class_for_tier(value)


@_described(_nullable({"type": "string"}))
def _suffix(name: str, value: Any) -> Any:
    if value is not None and not isinstance(value, str):
        raise _bad(name, f"suffix must be a string or null, got {_show(value)}")
    return value


@_described(_nullable({"type": "object", "maxProperties": MAX_LOGIT_BIAS,
                        "propertyNames": {"pattern": TOKEN_ID_KEY_PATTERN},
                        "additionalProperties": {"type": "number", "minimum": -MAX_ABS_LOGIT_BIAS,
                                                 "maximum": MAX_ABS_LOGIT_BIAS}}))
def _logit_bias(name: str, value: Any) -> Any:
    """OpenAI's logit_bias: {"<token id>": bias in [-100, 100]} -> {int id: float bias}.

    At most MAX_LOGIT_BIAS entries; keys are token ids written as decimal integers
    (no sign, no leading zeros, below 10**18). Ids beyond the vocabulary are refused by the engine's
    rule (checked before the request is submitted, see serving.prepare_prompts)."""
    if value is None:
        return None
    if not isinstance(value, dict):
        raise _bad(name, "logit_bias must be an object mapping token ids to biases")
    if len(value) > MAX_LOGIT_BIAS:
        raise _bad(name, f"logit_bias accepts at most {MAX_LOGIT_BIAS} entries, got {len(value)}")
    bias: dict[int, float] = {}
    for key, v in value.items():
        if not isinstance(key, str) or not _TOKEN_ID_KEY.fullmatch(key):
            raise _bad(name, f"logit_bias keys must be token ids written as decimal integers, got {_show(key)}")
        if (not isinstance(v, (int, float)) or isinstance(v, bool) or not math.isfinite(v)
                or not -MAX_ABS_LOGIT_BIAS <= v <= MAX_ABS_LOGIT_BIAS):
            raise _bad(name, f"logit_bias values must be numbers in [-{MAX_ABS_LOGIT_BIAS:g}, "
                             f"{MAX_ABS_LOGIT_BIAS:g}], got {_show(v)} for token {key}")
        bias[int(key)] = float(v)
    return bias or None


@_described(_nullable({"type": "object", "properties": {"include_usage": _nullable({"type": "boolean"})},
                        "additionalProperties": False}))
def _stream_options(name: str, value: Any) -> Any:
    if value is None:
        return None
    if not isinstance(value, dict) or set(value) - {"include_usage"}:
        raise _bad(name, "stream_options must be an object with the only key include_usage")
    return {"include_usage": _bool("stream_options.include_usage", value.get("include_usage"))}


_JSON_SCHEMA_ANY = {"type": "object"}
_RESPONSE_FORMAT_SCHEMA = {"type": "object", "required": ["type"], "additionalProperties": False, "properties": {
    "type": {"enum": ["text", "json_object", "json_schema"]},
    "json_schema": {"type": "object", "required": ["schema"], "additionalProperties": False, "properties": {
        "name": {"type": "string"}, "description": {"type": "string"}, "schema": _JSON_SCHEMA_ANY,
        "strict": _nullable({"type": "boolean"})}}}}


@_described(_nullable(_RESPONSE_FORMAT_SCHEMA))
def _response_format(name: str, value: Any) -> Any:
    """text (None), json_object or json_schema -> a StructuredSpec (server/response_format.py)."""
    return response_format_spec(name, value)


_guided_json = _described(_nullable({"anyOf": [_JSON_SCHEMA_ANY, {"type": "string"}]}))(guided_checker("guided_json"))
_guided_regex = _described(_nullable({"type": "string", "minLength": 1}))(guided_checker("guided_regex"))
_guided_choice = _described(_nullable({"type": "array", "items": {"type": "string", "minLength": 1}, "minItems": 1}))(
    guided_checker("guided_choice"))
_guided_grammar = _described(_nullable({"type": "string"}))(guided_checker("guided_grammar"))
_structured_outputs = _described(_nullable({"type": "object", "additionalProperties": False, "properties": {
    "json": _nullable({"anyOf": [_JSON_SCHEMA_ANY, {"type": "string"}]}), "regex": _nullable({"type": "string"}),
    "choice": _nullable({"type": "array", "items": {"type": "string"}}),
    "grammar": _nullable({"type": "string"})}}))(structured_outputs_spec)


_PROMPT_LIST = {"type": "array", "minItems": 1, "maxItems": MAX_PROMPTS}
_TOKEN_IDS = {"type": "array", "minItems": 1, "items": TOKEN_ID_SCHEMA}


@_described({"anyOf": [{"type": "string"}, {**_PROMPT_LIST, "items": {"type": "string"}}, _TOKEN_IDS,
                       {**_PROMPT_LIST, "items": _TOKEN_IDS}]})
def _prompt(name: str, value: Any) -> Any:
    """prompt, checked in place (``_completion_prompts``); parse_completion reads it again."""
    _completion_prompts(value)
    return value


COMMON_FIELDS: dict[str, Callable] = {
    "model": _string(256),
    "max_tokens": _int(1, INT64_MAX),
    "temperature": _number(0.0, 2.0),
    "top_p": _number(0.0, 1.0, open_lo=True),
    "top_k": _int(-1, INT64_MAX),
    "min_p": _number(0.0, 1.0),
    "n": _int(1, INT64_MAX),
    "presence_penalty": _number(-2.0, 2.0),
    "frequency_penalty": _number(-2.0, 2.0),
    "repetition_penalty": _number(0.0, 100.0, open_lo=True),
    "seed": _int(),
    "stop": _stop,
    "stop_token_ids": _token_list,
    "min_tokens": _int(0, INT64_MAX),
    "ignore_eos": _bool,
    "skip_special_tokens": _bool,
    "include_stop_str_in_output": _bool,
    "stream": _bool,
    "stream_options": _stream_options,
    "user": _string(MAX_USER_CHARS),
    "logit_bias": _logit_bias,
    "deadline_s": _number(0.0, MAX_DEADLINE_S, open_lo=True),
    "priority": _int(-MAX_PRIORITY, MAX_PRIORITY),
    "use_prefix_cache": _bool,
    "num_speculative_tokens": _int(0, 16),
    "service_tier": _service_tier,
    "metadata": check_metadata,
    "store": check_store,
    "safety_identifier": _string(MAX_USER_CHARS),
    "prompt_cache_key": _string(MAX_USER_CHARS),
    "return_token_ids": _bool,                    # vLLM's extension: the prompt's and each choice's token ids
    "guided_json": _guided_json,                  # vLLM's structured-output extensions
    "guided_regex": _guided_regex,
    "guided_choice": _guided_choice,
    "guided_grammar": _guided_grammar,
    "structured_outputs": _structured_outputs,
}
COMPLETION_FIELDS: dict[str, Callable] = {
    **COMMON_FIELDS,
    "prompt": _prompt,
    "echo": _bool,
    "logprobs": _int(0, MAX_LOGPROBS),
    "best_of": _int(1, INT64_MAX),
    "suffix": _suffix,                            # fill in the middle; see _check_suffix
}
CHAT_FIELDS: dict[str, Callable] = {
    **COMMON_FIELDS,
    "messages": check_messages,                   # roles here; content by the chat template renderer
    "max_completion_tokens": _int(1, INT64_MAX),
    "logprobs": _bool,
    "top_logprobs": _int(0, MAX_LOGPROBS),
    "response_format": _response_format,
    "tools": check_tools,                         # tool calling: kvserve/server/tools.py
    "tool_choice": check_tool_choice,
    "parallel_tool_calls": _bool,
    "functions": _only_null("legacy function calling: send tools"),
    "function_call": _only_null("legacy function calling: send tool_choice"),
    "modalities": _only_null("output modalities"),
    "audio": _only_null("audio output"),
    "prediction": _only_null("predicted outputs"),
    "reasoning_effort": _only_null("reasoning effort"),
    "web_search_options": _only_null("web search"),
}
SAMPLING_FIELDS = ("n", "temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty",
                   "repetition_penalty", "seed", "stop", "stop_token_ids", "min_tokens", "ignore_eos",
                   "skip_special_tokens", "include_stop_str_in_output", "logit_bias")


def check_fields(body: dict, table: dict[str, Callable]) -> dict:
    """Every known field checked and normalised; unknown fields rejected by name."""
    unknown = sorted(set(body) - set(table))
    if unknown:
        raise InvalidRequestError(f"unknown or unsupported field {unknown[0]!r}", param=unknown[0],
                                  code="unknown_parameter")
    return {name: table[name](name, value) for name, value in body.items()}


def _sampling_params(values: dict, max_tokens: int | None, logprobs: int | None) -> SamplingParams:
    kwargs = {name: values[name] for name in SAMPLING_FIELDS if values.get(name) is not None}
    params = SamplingParams(max_tokens=max_tokens, logprobs=logprobs, **kwargs)
    params.validate()
    return params


def _stream_flags(values: dict) -> tuple[bool, bool]:
    stream = bool(values.get("stream"))
    options = values.get("stream_options")
    if options is not None and not stream:
        raise _bad("stream_options", "stream_options is only allowed when stream is true")
    return stream, bool(options and options.get("include_usage"))


# ------------------------------------------------------------------ requests
def _completion_prompts(value: Any) -> list[Prompt]:
    """prompt: a string, a list of strings, a list of token ids or a list of token-id lists."""
    def is_ids(item: Any) -> bool:
        return isinstance(item, list) and bool(item) and all(_is_token_id(t) for t in item)

    if isinstance(value, str):
        prompts = [Prompt(text=value)]
    elif is_ids(value):
        prompts = [Prompt(token_ids=[int(t) for t in value])]
    elif isinstance(value, list) and value and all(isinstance(p, str) for p in value):
        prompts = [Prompt(text=p) for p in value]
    elif isinstance(value, list) and value and all(is_ids(p) for p in value):
        prompts = [Prompt(token_ids=[int(t) for t in p]) for p in value]
    else:
        raise _bad("prompt", "prompt must be a string, a non-empty list of strings, a non-empty list of "
                             "token ids or a list of such lists")
    if len(prompts) > MAX_PROMPTS:
        raise _bad("prompt", f"at most {MAX_PROMPTS} prompts per request, got {len(prompts)}")
    return prompts


def _check_choices(num_prompts: int, n: int) -> None:
    if num_prompts * n > MAX_CHOICES:
        raise _bad("n", f"prompts x n must be at most {MAX_CHOICES}, got {num_prompts} x {n}")


def _check_suffix(suffix: str | None, prompts: list[Prompt], echo: bool) -> None:
    """suffix (fill in the middle) is built around a text prompt and the prompt the model
    sees is not the text sent: so no token-id prompts and no echo."""
    if suffix is None:
        return
    if any(p.text is None for p in prompts):
        raise _bad("suffix", "suffix needs text prompts: the fill-in-the-middle prompt is built from the "
                             "prompt's text (send token ids with the FIM tokens already in place instead)")
    if echo:
        raise _bad("suffix", "suffix cannot be combined with echo: the model sees a fill-in-the-middle "
                             "prompt, not the prompt text that would be echoed")


def parse_completion(body: dict) -> GenerateSpec:
    """A /v1/completions body -> GenerateSpec (InvalidRequestError naming the bad field)."""
    values = check_fields(body, COMPLETION_FIELDS)
    if "prompt" not in values:
        raise _bad("prompt", "prompt is required")
    prompts = _completion_prompts(values["prompt"])
    n = values.get("n") or 1
    best_of = values.get("best_of")
    if best_of is not None and best_of != n:
        raise _bad("best_of", "best_of must equal n (server-side best-of selection is not supported)")
    params = _sampling_params(values, values.get("max_tokens"), values.get("logprobs"))
    if values.get("echo") and values.get("logprobs") is not None:
        params.prompt_logprobs = values["logprobs"]        # the echoed prompt carries logprobs too
    _check_choices(len(prompts), params.n)
    stream, include_usage = _stream_flags(values)
    _check_suffix(values.get("suffix"), prompts, bool(values.get("echo")))
    return GenerateSpec(kind="completion", model=values.get("model"), params=params, prompts=prompts,
                        implicit_max_tokens=None if values.get("max_tokens") else COMPLETION_DEFAULT_MAX_TOKENS,
                        stream=stream, include_usage=include_usage, echo=bool(values.get("echo")),
                        suffix=values.get("suffix"),
                        logprobs=values.get("logprobs"), user=values.get("user"),
                        safety_identifier=values.get("safety_identifier"),
                        prompt_cache_key=values.get("prompt_cache_key"),
                        deadline_s=values.get("deadline_s"), priority=values.get("priority") or 0,
                        use_prefix_cache=values.get("use_prefix_cache") is not False,
                        return_token_ids=bool(values.get("return_token_ids")),
                        num_speculative_tokens=values.get("num_speculative_tokens"),
                        service_class=values.get("service_tier"), structured=structured_from(values))


def _chat_max_tokens(values: dict) -> tuple[int | None, str]:
    max_tokens, max_completion = values.get("max_tokens"), values.get("max_completion_tokens")
    if max_tokens is not None and max_completion is not None and max_tokens != max_completion:
        raise _bad("max_completion_tokens", "max_tokens and max_completion_tokens disagree; send one")
    if max_completion is not None:
        return max_completion, "max_completion_tokens"
    return max_tokens, "max_tokens"


def parse_chat(body: dict) -> GenerateSpec:
    """A /v1/chat/completions body -> GenerateSpec (messages are checked when rendered)."""
    values = check_fields(body, CHAT_FIELDS)
    messages = values.get("messages")
    if not isinstance(messages, list) or not messages:
        raise _bad("messages", "messages must be a non-empty list of message objects")
    top_logprobs = values.get("top_logprobs")
    if top_logprobs is not None and not values.get("logprobs"):
        raise _bad("top_logprobs", "top_logprobs requires logprobs to be true")
    logprobs = (top_logprobs or 0) if values.get("logprobs") else None
    max_tokens, max_param = _chat_max_tokens(values)
    params = _sampling_params(values, max_tokens, logprobs)
    _check_choices(1, params.n)
    stream, include_usage = _stream_flags(values)
    tools = tool_config(values)
    check_tool_messages(messages)
    return GenerateSpec(kind="chat", tools=tools, model=values.get("model"), params=params, messages=messages,
                        max_tokens_param=max_param, stream=stream, include_usage=include_usage,
                        logprobs=logprobs, user=values.get("user"), deadline_s=values.get("deadline_s"),
                        safety_identifier=values.get("safety_identifier"),
                        prompt_cache_key=values.get("prompt_cache_key"),
                        priority=values.get("priority") or 0,
                        use_prefix_cache=values.get("use_prefix_cache") is not False,
                        return_token_ids=bool(values.get("return_token_ids")),
                        num_speculative_tokens=values.get("num_speculative_tokens"),
                        service_class=values.get("service_tier"), structured=structured_from(values))


TOKENIZE_FIELDS: dict[str, Callable] = {
    "model": _string(256), "prompt": _string(2**24), "messages": check_messages,
    "add_special_tokens": _bool, "add_generation_prompt": _bool,
}
DETOKENIZE_FIELDS: dict[str, Callable] = {"model": _string(256), "tokens": _token_list}


def parse_tokenize(body: dict) -> dict:
    """/tokenize: {"prompt": str} or {"messages": [...]}, optional model, add_special_tokens,
    add_generation_prompt."""
    values = check_fields(body, TOKENIZE_FIELDS)
    if (values.get("prompt") is None) == (values.get("messages") is None):
        raise _bad("prompt", "send exactly one of prompt or messages")
    return values


def parse_detokenize(body: dict) -> dict:
    """/detokenize: {"tokens": [ids]} with an optional model."""
    values = check_fields(body, DETOKENIZE_FIELDS)
    if values.get("tokens") is None:
        raise _bad("tokens", "tokens is required")
    return values
