"""One generation request from validated spec to response: tokenise, check the context,
admit, submit to the engine, then collect (whole body) or stream (SSE).

Every engine request of an HTTP request puts its events on one sink queue. Control
events come through the same queue: the client disconnected, the deadline passed,
or the server is draining. So the consumer only ever waits on ``sink.get()``::

    engine client ──(prompt index, delta / output / error)──┐
    disconnect watcher ──(CONTROL, "disconnect")────────────┼──▶ sink ──▶ collect() / stream()
    deadline timer / drain ──(CONTROL, "deadline"/"drain")──┘
"""
from __future__ import annotations

import asyncio
import itertools
import logging
import time
import uuid
from dataclasses import dataclass
from typing import AsyncIterator

from kvserve.engine import admission
from kvserve.engine.admission import EngineLimits
from kvserve.engine.request import EngineRequest
from kvserve.engine.service_class import ServiceClass
from kvserve.errors import ContextLengthExceededError, InvalidRequestError, KVServeError
from kvserve.frontend.output_processor import CompletionDelta
from kvserve.frontend.outputs import RequestOutput
from kvserve.server.auth import cache_salt
from kvserve.server.classes import tier_for_class
from kvserve.server.errors import DeadlineExceededError
from kvserve.server.guarding import output_screen
from kvserve.server.protocol import GenerateSpec
from kvserve.server.responses import SSE_DONE, ResponseBuilder, sse
from kvserve.server.tenancy import RequestAccount
from kvserve.server.timing import RequestTiming, combine_timings, format_server_timing, server_timing_comment
from kvserve.server.tool_prompt import render_chat_prompt
from kvserve.tokenizer.fim import build_fim_prompt, require_fim

CONTROL = -1
logger = logging.getLogger("kvserve.server")
_ids = itertools.count()


@dataclass
class PreparedPrompt:
    text: str | None
    token_ids: list[int]


# ------------------------------------------------------------------ prompts
MAX_CHARS_PER_TOKEN = 64     # no vocabulary's token spells more: a longer text cannot fit the context


def prompt_chars(spec: GenerateSpec) -> tuple[int, str]:
    """Characters of text the request asks to tokenise, and the field that holds them."""
    if spec.kind == "chat":
        return sum(_text_chars(m) for m in spec.messages), "messages"
    return sum(len(p.text or "") for p in spec.prompts) + len(spec.suffix or ""), "prompt"


def _text_chars(value) -> int:
    """Characters in every string of a message (its role, content and content parts)."""
    if isinstance(value, str):
        return len(value)
    if isinstance(value, dict):
        return sum(_text_chars(v) for v in value.values())
    if isinstance(value, list):
        return sum(_text_chars(v) for v in value)
    return 0


def check_prompt_size(spec: GenerateSpec, info) -> None:
    """Refuse by size, before any tokenising, a prompt whose text cannot fit the context
    (more than ``MAX_CHARS_PER_TOKEN`` characters per context token), or a chat with more
    messages than the context has tokens: a 4 MiB body is refused at once."""
    chars, param = prompt_chars(spec)
    limit = info.max_model_len * MAX_CHARS_PER_TOKEN
    if chars > limit:
        raise ContextLengthExceededError(
            f"the prompt has {chars} characters; this model's context of {info.max_model_len} tokens "
            f"cannot hold more than {limit}", param=param)
    if spec.kind == "chat" and len(spec.messages) >= info.max_model_len:
        raise ContextLengthExceededError(
            f"{len(spec.messages)} messages cannot fit this model's context of {info.max_model_len} tokens",
            param="messages")


def prepare_prompts(spec: GenerateSpec, tokenizer, info) -> list[PreparedPrompt]:
    """Token ids of every prompt, each checked against the context and the KV cache.
    Tokenising is slow for long texts: the HTTP loop calls this in a worker thread."""
    check_prompt_size(spec, info)
    check_logit_bias(spec, info)
    if spec.kind == "chat":
        text = render_chat_prompt(tokenizer, spec.messages, spec.tools)
        prompts = [PreparedPrompt(text, tokenizer.encode(text, add_special_tokens=False))]
        param = "messages"
    else:
        prompts = completion_prompts(spec, tokenizer, info)
        param = "prompt"
    for prompt in prompts:
        check_context(prompt.token_ids, spec, info, param)
    return prompts


def completion_prompts(spec: GenerateSpec, tokenizer, info) -> list[PreparedPrompt]:
    """Token ids of a completions request's prompts. With ``spec.suffix`` every (text) prompt
    becomes a fill-in-the-middle prompt around that suffix (kvserve/tokenizer/fim.py); a
    vocabulary without FIM tokens is refused with InvalidRequestError(param="suffix")."""
    if spec.suffix is not None:
        fim = require_fim(tokenizer.fim_tokens, spec.model)
        return [PreparedPrompt(p.text, build_fim_prompt(tokenizer, fim, p.text, spec.suffix))
                for p in spec.prompts]
    prompts = []
    for p in spec.prompts:
        if p.token_ids is not None:
            admission.check_token_ids(p.token_ids, info.vocab_size)
            prompts.append(PreparedPrompt(None, list(p.token_ids)))
        else:
            prompts.append(PreparedPrompt(p.text, tokenizer.encode(p.text)))
    return prompts


def apply_generation_length(spec: GenerateSpec, prompts: list[PreparedPrompt], info,
                            default_max_tokens: int | None, max_tokens_limit: int | None) -> None:
    """The server's generation-length rules on ``spec.params.max_tokens`` (in place): above
    ``max_tokens_limit`` is a 400 naming the field; a request that names no length gets the
    smallest of its own implicit length (completions: 16, OpenAI's), ``default_max_tokens``
    and ``max_tokens_limit``, cut to what its longest prompt leaves of the context, instead
    of running to the end of the context (no caps at all: the old behaviour)."""
    asked = spec.params.max_tokens
    if asked is not None and max_tokens_limit is not None and asked > max_tokens_limit:
        raise InvalidRequestError(f"{spec.max_tokens_param} is {asked}; this server allows at most "
                                  f"{max_tokens_limit}", param=spec.max_tokens_param)
    caps = [x for x in (spec.implicit_max_tokens, default_max_tokens, max_tokens_limit) if x is not None]
    if asked is None and caps:
        room = info.max_model_len - max(len(p.token_ids) for p in prompts)
        spec.params.max_tokens = max(1, min(*caps, room))


def token_reservation(spec: GenerateSpec, prompts: list[PreparedPrompt], info) -> int:
    """The most tokens a request can use: every prompt plus ``n x max_tokens`` for each
    (a request without a length may run to the end of the context)."""
    total = 0
    for prompt in prompts:
        max_tokens = spec.params.max_tokens
        if max_tokens is None:
            max_tokens = max(info.max_model_len - len(prompt.token_ids), 0)
        total += len(prompt.token_ids) + spec.params.n * max_tokens
    return total


def new_request_id(kind: str) -> str:
    """A response id: ``cmpl-...`` for completions, ``chatcmpl-...`` for chat."""
    return f"{'cmpl' if kind == 'completion' else 'chatcmpl'}-{uuid.uuid4().hex[:24]}"


def engine_limits(info) -> EngineLimits:
    """The engine's numbers (from ``EngineReady``) that admission checks against."""
    return EngineLimits(info.max_model_len, info.vocab_size, info.block_size, info.num_blocks, info.kv_max_tokens)


def check_logit_bias(spec: GenerateSpec, info) -> None:
    """The engine's vocabulary rule for ``logit_bias``, checked here too so that a streamed
    request is refused with a 400 before any header is sent."""
    admission.check_logit_bias(spec.params.logit_bias, info.vocab_size)


def check_context(token_ids: list[int], spec: GenerateSpec, info, param: str) -> None:
    """The engine's admission rule, checked before any header is sent: never a silent clamp."""
    admission.check_context(len(token_ids), spec.params.max_tokens, engine_limits(info), param,
                            spec.max_tokens_param)


# ----------------------------------------------------------------- handler
class Generation:
    """The engine requests of one HTTP request and the events that come back. ``adapter``
    is the LoRA adapter's name the request's model selected (None: the base model); the
    responses name it as their model. ``service_class`` is the class it runs in (the
    key's pin, else the one asked for, else chat: ``classes.choose_class``); the responses
    name its tier."""

    def __init__(self, ctx, spec: GenerateSpec, prompts: list[PreparedPrompt], tenant: str | None,
                 adapter: str | None, service_class: ServiceClass, account: RequestAccount):
        self.ctx, self.spec, self.prompts, self.tenant, self.adapter = ctx, spec, prompts, tenant, adapter
        self.service_class = service_class
        self.tracked: list = []                     # the engine client's TrackedRequests (their timings)
        self.account = account                      # its rate-limit ticket and audit record (app.generate)
        self.id = self.account.record.id
        self.sink: asyncio.Queue = asyncio.Queue()
        self.arrival = time.monotonic()
        self.engine_ids = [f"{self.id}-{i}-{next(_ids)}" for i in range(len(prompts))]
        self.outputs: dict[int, RequestOutput] = {}
        self.filtered: dict[int, str] = {}          # choice index -> "content_filter" once a guard stopped it
        self.builder = ResponseBuilder(spec.kind, self.id, adapter or ctx.model_name, ctx.speller, spec.logprobs,
                                       spec.params.n, tier_for_class(service_class), tools=spec.tools,
                                       skip_special_tokens=spec.params.skip_special_tokens,
                                       return_token_ids=spec.return_token_ids)
        self._deadline_handle: asyncio.TimerHandle | None = None
        self._seen_choice: set[int] = set()
        self.screen = output_screen(ctx, tenant, self.account.record, self.builder)   # None: no output guards
        # echo with logprobs: prompt logprobs gathered per prompt, echoed once complete
        self._prompt_logprobs: dict[int, list] = {tag: [None] for tag in range(len(prompts))}
        self._echoed: set[int] = set()

    @property
    def num_prompt_tokens(self) -> int:
        return sum(len(p.token_ids) for p in self.prompts)

    def submit(self) -> None:
        """Hand every prompt to the engine and arm the deadline (admission already passed)."""
        spec = self.spec
        for tag, (engine_id, prompt) in enumerate(zip(self.engine_ids, self.prompts)):
            request = EngineRequest(engine_id, prompt.token_ids, spec.params,
                                    frozenset(self.ctx.tokenizer.eos_token_ids), spec.priority, self.tenant,
                                    cache_salt=cache_salt(self.tenant), adapter_id=self.adapter,
                                    use_prefix_cache=spec.use_prefix_cache,
                                    num_speculative_tokens=spec.num_speculative_tokens,
                                    service_class=self.service_class, structured=spec.structured)
            self.tracked.append(self.ctx.client.submit(request, prompt.text, self.sink, tag, self.arrival))
        if self.adapter is not None:
            self.ctx.metrics.lora.requests.inc(adapter=self.adapter)
        logger.debug("admitted %s: %d prompt(s), %d prompt tokens, user=%r, safety_identifier=%r, "
                     "prompt_cache_key=%r, tenant=%r, adapter=%r, class=%s", self.id, len(self.prompts),
                     self.num_prompt_tokens, self.spec.user, self.spec.safety_identifier, self.spec.prompt_cache_key,
                     self.tenant, self.adapter, self.service_class.value)
        deadline_s = self.spec.deadline_s or self.ctx.default_deadline_s
        if deadline_s:
            loop = asyncio.get_running_loop()
            self._deadline_handle = loop.call_later(deadline_s, self.control, "deadline")
        self.ctx.active.add(self)

    def control(self, event: str) -> None:
        self.sink.put_nowait((CONTROL, event))

    def abort_all(self) -> None:
        """Abort every engine request still running; keep their partial outputs."""
        for tag, engine_id in enumerate(self.engine_ids):
            if tag not in self.outputs:
                output = self.ctx.client.abort(engine_id)
                if output is not None:
                    self.outputs[tag] = output

    def close(self) -> None:
        """Abort what still runs, and end the account (rate-limit ticket, audit line) once."""
        self.abort_all()
        if self._deadline_handle is not None:
            self._deadline_handle.cancel()
        self.ctx.active.discard(self)
        if not self.account.ended:
            self._fill_record()
            self.account.end(self.num_prompt_tokens + self._completion_tokens())

    def _fill_record(self) -> None:
        """The audit record's view of how the request went."""
        record = self.account.record
        record.adapter, record.service_class = self.adapter, self.service_class.value
        record.prompt_tokens, record.completion_tokens = self.num_prompt_tokens, self._completion_tokens()
        record.cached_tokens = self._cached_tokens()
        completions = [c for out in self.outputs.values() for c in out.outputs]
        record.finish_reasons = [self.filtered.get(self.builder.choice_index(tag, c.index), c.finish_reason or "")
                                 for tag, out in self.outputs.items() for c in out.outputs]
        record.timings_ms = {k: round(v, 3) for k, v in self.timing(ended=True).phases_ms().items()}
        if self.ctx.tenancy.keeps_text(self.tenant):
            record.prompt_text = "\n".join(p.text or "" for p in self.prompts)
            record.output_text = [c.text for c in completions]

    # ----------------------------------------------------------------- timing
    def timing(self, ended: bool = False) -> RequestTiming:
        """Its phases' instants over every prompt; ``ended``: the response ends now, so an
        engine request still without a finish time counts as finished now."""
        parts = [(t.scheduled_at, t.first_token_time, t.finish_time) for t in self.tracked]
        return combine_timings(self.arrival, parts, time.monotonic() if ended else None)

    @property
    def first_token_seen(self) -> bool:
        """Whether any of its engine requests has produced a token."""
        return any(t.first_token_time is not None for t in self.tracked)

    def server_timing(self, ended: bool = True) -> str:
        """The ``Server-Timing`` header value: every known phase (the total once ``ended``)."""
        return format_server_timing(self.timing(ended).phases_ms())

    def _done_chunks(self) -> list[bytes]:
        """The stream's end: the server-timing comment with the total, then ``[DONE]``."""
        return [server_timing_comment(self.timing(ended=True).phases_ms()), SSE_DONE]

    def _finished(self) -> bool:
        return len(self.outputs) == len(self.prompts)

    def _completion_tokens(self) -> int:
        return sum(len(c.token_ids) for out in self.outputs.values() for c in out.outputs)

    def _cached_tokens(self) -> int:
        return sum(out.num_cached_tokens for out in self.outputs.values())

    # ------------------------------------------------------------- whole body
    async def collect(self) -> dict | None:
        """Wait for every output; the response body, or None if the client went away."""
        try:
            while not self._finished():
                tag, event = await self.sink.get()
                if tag == CONTROL:
                    if event == "disconnect":
                        self.account.record.refuse(499, "client_disconnected")
                        return None
                    if event == "deadline":
                        self.account.record.refuse(504, DeadlineExceededError.code)
                        raise DeadlineExceededError("the request's deadline passed before it finished",
                                                    param="deadline_s")
                    self.abort_all()                          # drain timeout: finish_reason abort
                elif isinstance(event, CompletionDelta):
                    await self._screen_delta(tag, event, [])     # a violation stops it early
                elif isinstance(event, RequestOutput):
                    self.outputs[tag] = event
                elif isinstance(event, KVServeError):
                    self.account.record.refuse(event.http_status, event.code)
                    raise event
            if self.screen is not None:
                await self.screen.screen_outputs(self)
            return self._full_body()
        finally:
            self.close()

    def _full_body(self) -> dict:
        choices = []
        for tag, output in self.outputs.items():
            prefix = self._echo_prefix(tag)
            echo_lps = (self.builder.echo_logprobs(self.prompts[tag].token_ids, output.prompt_logprobs)
                        if self.spec.echo else None)
            for completion in output.outputs:
                index = self.builder.choice_index(tag, completion.index)
                if self.screen is not None:
                    completion = self.screen.screened(index, completion, self.filtered)
                if self.spec.kind == "completion":
                    choices.append(self.builder.completion_choice(index, completion, prefix, echo_lps,
                                                                  self.prompts[tag].token_ids))
                else:
                    choices.append(self.builder.chat_choice(index, completion))
        return self.builder.full(choices, self.num_prompt_tokens, self._completion_tokens(), self._cached_tokens(),
                                 self.prompts[0].token_ids)

    def _echo_prefix(self, tag: int) -> str:
        if not self.spec.echo:
            return ""
        prompt = self.prompts[tag]
        return prompt.text if prompt.text is not None else self.ctx.tokenizer.decode(prompt.token_ids)

    # ----------------------------------------------------------------- stream
    async def stream(self) -> AsyncIterator[bytes]:
        """SSE chunks; ends with the server-timing comment and ``[DONE]`` (after an error event
        if the request failed)."""
        try:
            for chunk in self._echo_chunks():
                yield chunk
            while not self._finished():
                tag, event = await self.sink.get()
                if tag == CONTROL:
                    if event == "disconnect":
                        self.account.record.refuse(499, "client_disconnected")
                        return
                    if event == "deadline":
                        self.account.record.refuse(200, DeadlineExceededError.code)
                        yield sse(DeadlineExceededError("the request's deadline passed before it finished",
                                                        param="deadline_s").to_dict())
                        for chunk in self._done_chunks():
                            yield chunk
                        return
                    self.abort_all()
                    for chunk in self._abort_chunks():
                        yield chunk
                elif isinstance(event, CompletionDelta):
                    chunks = self._echo_with_logprobs(tag, event)
                    if self.builder.choice_index(tag, event.index) not in self.filtered:
                        chunk = self._delta_chunk(tag, event)
                        chunks += [chunk] if chunk is not None else []
                    for chunk in await self._screen_delta(tag, event, chunks):
                        yield chunk
                elif isinstance(event, RequestOutput):
                    self.outputs[tag] = event
                elif isinstance(event, KVServeError):
                    self.account.record.refuse(200, event.code)      # the stream had begun: an error event
                    yield sse(event.to_dict())
                    for chunk in self._done_chunks():
                        yield chunk
                    return
            if self.spec.include_usage:
                yield sse(self.builder.usage_chunk(self.num_prompt_tokens, self._completion_tokens(),
                                                   self._cached_tokens()))
            for chunk in self._done_chunks():
                yield chunk
        finally:
            self.close()

    def _echo_with_logprobs(self, tag: int, delta: CompletionDelta) -> list[bytes]:
        """Streaming echo with logprobs: the prompt's chunk goes out once its prompt
        logprobs are all in (they come with the prefill, before the first token)."""
        if not (self.spec.echo and self.spec.logprobs is not None) or tag in self._echoed:
            return []
        gathered = self._prompt_logprobs[tag]
        gathered.extend(delta.prompt_logprobs or ())
        prompt_ids = self.prompts[tag].token_ids
        if len(gathered) < len(prompt_ids) and not delta.token_ids and delta.finish_reason is None:
            return []
        self._echoed.add(tag)
        entries = gathered + [None] * (len(prompt_ids) - len(gathered))
        prefix = self._echo_prefix(tag)
        return [sse(self.builder.chunk(self.builder.choice_index(tag, i), prefix, prompt_ids, entries))
                for i in range(self.spec.params.n)]

    def _echo_chunks(self) -> list[bytes]:
        if not self.spec.echo or self.spec.logprobs is not None:     # with logprobs: sent later
            return []
        chunks = []
        for tag in range(len(self.prompts)):
            for i in range(self.spec.params.n):
                chunks.append(sse(self.builder.chunk(self.builder.choice_index(tag, i), self._echo_prefix(tag))))
        return chunks

    def _delta_chunk(self, tag: int, delta: CompletionDelta) -> bytes | None:
        """The chunk of one delta (None: nothing to send; with ``return_token_ids`` a delta whose
        text is held back still sends its ids)."""
        if not delta.text and delta.finish_reason is None and not delta.logprobs \
                and not (self.spec.return_token_ids and delta.token_ids):
            return None
        index = self.builder.choice_index(tag, delta.index)
        first = index not in self._seen_choice
        self._seen_choice.add(index)
        chunk = self.builder.chunk(index, delta.text, delta.token_ids, delta.logprobs, delta.finish_reason,
                                   delta.stop_reason, role=first and self.spec.kind == "chat")
        return sse(self.builder.with_token_ids(chunk, delta.token_ids, self.prompts[tag].token_ids if first else None))

    async def _screen_delta(self, tag: int, delta: CompletionDelta, chunks: list[bytes]) -> list[bytes]:
        """The chunks to send now: without guards, ``chunks``; with them, the chunks held
        since the last check once it passes, or the choice's content_filter end once it
        fails (its engine request is aborted: every choice of that prompt ends so)."""
        if self.screen is None:
            return chunks
        index = self.builder.choice_index(tag, delta.index)
        if index in self.filtered:
            return chunks
        released = await self.screen.on_delta(index, delta, chunks)
        if released is not None:
            return released
        output = self.ctx.client.abort(self.engine_ids[tag])
        if output is not None:
            self.outputs[tag] = output
        ends = []
        for i in range(self.spec.params.n):
            stopped = self.builder.choice_index(tag, i)
            self.filtered[stopped] = "content_filter"
            self.screen.drop(stopped)
            if self.spec.stream:
                first = not self.screen.has_released(stopped) and self.spec.kind == "chat"
                ends.append(sse(self.builder.chunk(stopped, "", finish_reason="content_filter", role=first)))
        return ends

    def _abort_chunks(self) -> list[bytes]:
        """Final chunks (finish_reason ``abort``) of completions ended by a drain."""
        chunks = []
        for tag, output in self.outputs.items():
            for completion in output.outputs:
                if completion.finish_reason == "abort":
                    index = self.builder.choice_index(tag, completion.index)
                    chunks.append(sse(self.builder.chunk(index, "", finish_reason="abort",
                                                         role=index not in self._seen_choice
                                                         and self.spec.kind == "chat")))
        return chunks

