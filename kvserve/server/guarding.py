"""The guards (``kvserve/guards``) in the HTTP request path: a tenant's input before
admission, its output stream in windows, its whole output at the end.

- Input: every text the request carries (chat message contents, completion prompts —
  token-id prompts decoded, so ids do not slip past — and ``suffix``) is checked as one
  text; a block is a 400 ``content_policy_violation``, a redaction rewrites the pieces
  in place before tokenising.
- Output: ``OutputScreen`` holds one choice's SSE chunks back until a check passes
  (``guards/stream.py``): every ``every_tokens`` tokens the stream guards see the window,
  and at the end the output guards see the whole text. A block ends the choice with
  ``finish_reason: "content_filter"`` and its held text is never sent. A tenant with
  output guards but no stream guards has its whole output held until the end (nothing
  unchecked is sent). Non-streamed requests take the same checks as their tokens
  arrive, so a violation stops generation early there too.

Every guard decision goes to the audit record (with its reason, never the matched text)
and to ``kvserve_guard_latency_seconds`` / ``kvserve_guard_decisions_total``.
"""
from __future__ import annotations

import dataclasses

from kvserve.frontend.outputs import CompletionOutput
from kvserve.guards.base import Action, GuardContext, GuardPoint, join_segments, redact_segments
from kvserve.guards.classifiers import EngineClassifier
from kvserve.guards.config import build_guard_sets as build_sets
from kvserve.guards.runner import GuardOutcome, GuardSet
from kvserve.guards.stream import StreamGuard
from kvserve.server.audit import AuditRecord
from kvserve.server.responses import sse

HOLD_WHOLE_OUTPUT = 2**62            # every_tokens of a stream guard that only checks at the end


def build_guard_sets(tenants, ctx) -> dict[str, GuardSet]:
    """tenant -> GuardSet from the tenants file's ``[guards]`` (model guards ask the
    server's own engine through ``ctx.client``); empty without a tenants file."""
    if tenants is None or not tenants.guards:
        return {}

    def make_classifier(adapter: str | None) -> EngineClassifier:
        return EngineClassifier(lambda: ctx.client, ctx.tokenizer, adapter=adapter)
    return build_sets(tenants.guards, {name: t.guards for name, t in tenants.tenants.items()}, make_classifier,
                      ctx.metrics.tenants.observe_guard)


def record_outcome(record: AuditRecord, outcome: GuardOutcome) -> None:
    """Every guard's decision in ``outcome`` into the audit record."""
    for result in outcome.results:
        reason = result.reason if result.action is not Action.ALLOW or result.decision != "allow" else None
        record.add_guard(result.guard, result.point.value, result.decision, reason or None, result.seconds)


# ------------------------------------------------------------------- input
def _input_slots(spec, tokenizer) -> list[tuple[str, object]]:
    """(text, setter) for every piece of text a request carries."""
    slots = []
    if spec.kind == "chat":
        for message in spec.messages:
            content = message.get("content")
            if isinstance(content, str):
                slots.append((content, lambda text, m=message: m.__setitem__("content", text)))
            elif isinstance(content, list):
                for part in content:
                    if isinstance(part, dict) and isinstance(part.get("text"), str):
                        slots.append((part["text"], lambda text, p=part: p.__setitem__("text", text)))
        return slots
    for prompt in spec.prompts:
        text = prompt.text if prompt.text is not None else tokenizer.decode(prompt.token_ids)

        def set_prompt(new: str, p=prompt) -> None:
            p.text, p.token_ids = new, None
        slots.append((text, set_prompt))
    if spec.suffix is not None:
        slots.append((spec.suffix, lambda text: setattr(spec, "suffix", text)))
    return slots


async def guard_input(ctx, spec, record: AuditRecord) -> None:
    """Run the tenant's input guards on the request's text: 400 on a block, the pieces
    rewritten on a redaction."""
    guards = ctx.tenancy.guards(record.tenant)
    if guards is None or not guards.has(GuardPoint.INPUT):
        return
    slots = _input_slots(spec, ctx.tokenizer)
    texts = [text for text, _setter in slots]
    context = GuardContext(record.tenant, record.id, GuardPoint.INPUT)
    outcome = await guards.run(GuardPoint.INPUT, join_segments(texts), context)
    record_outcome(record, outcome)
    if outcome.blocked:
        raise outcome.error("messages" if spec.kind == "chat" else "prompt")
    if outcome.redacted:
        for (old, setter), new in zip(slots, redact_segments(texts, outcome.spans)):
            if new != old:
                setter(new)


# ------------------------------------------------------------------ output
def output_screen(ctx, tenant: str | None, record: AuditRecord, builder) -> "OutputScreen | None":
    """The screen of a request whose tenant has stream or output guards (else None)."""
    guards = ctx.tenancy.guards(tenant)
    if guards is None or not (guards.has(GuardPoint.STREAM) or guards.has(GuardPoint.OUTPUT)):
        return None
    return OutputScreen(guards, GuardContext(tenant, record.id, GuardPoint.STREAM), record, builder)


class OutputScreen:
    """One request's output guards: a ``StreamGuard`` per choice index (see the module
    docstring). The Generation asks ``on_delta`` for the chunks it may send."""

    def __init__(self, guards: GuardSet, context: GuardContext, record: AuditRecord, builder):
        self.guards, self.context, self.record, self.builder = guards, context, record, builder
        self._streams: dict[int, StreamGuard] = {}
        self._released: set[int] = set()          # choice indexes with a chunk sent
        self._final_checked: set[int] = set()

    def _stream(self, index: int) -> StreamGuard:
        stream = self._streams.get(index)
        if stream is None:
            stream = self.guards.stream_guard() or StreamGuard(HOLD_WHOLE_OUTPUT, 0)
            self._streams[index] = stream
        return stream

    def has_released(self, index: int) -> bool:
        return index in self._released

    def drop(self, index: int) -> None:
        """The choice ended by the filter: nothing held is sent."""
        stream = self._streams.get(index)
        if stream is not None and not stream.stopped:
            stream.block()

    async def on_delta(self, index: int, delta, chunks: list[bytes]) -> list[bytes] | None:
        """The chunks to send now ([] while held back), or None when a guard blocked."""
        final = delta.finish_reason is not None
        stream = self._stream(index)
        if not stream.feed(delta.text, len(delta.token_ids), tuple(chunks) if chunks else None, final):
            return []
        outcome, release = await self.guards.check_stream(stream, self.context, final)
        record_outcome(self.record, outcome)
        if final:
            self._final_checked.add(index)
        if release is None:
            return None
        if release.redacted:                      # one chunk with the redacted text (no per-token logprobs)
            out = [sse(self.builder.chunk(index, release.text, finish_reason=delta.finish_reason if final else None,
                                          stop_reason=delta.stop_reason if final else None,
                                          role=index not in self._released and self.builder.kind == "chat"))]
        else:
            out = [chunk for item in release.items for chunk in item]
        if out:
            self._released.add(index)
        return out

    async def screen_outputs(self, generation) -> None:
        """Non-streamed: the whole-output check of every choice whose last delta did not
        get one (aborted, or no delta came); a block marks it filtered."""
        for tag, output in generation.outputs.items():
            for completion in output.outputs:
                index = generation.builder.choice_index(tag, completion.index)
                if index in generation.filtered or index in self._final_checked:
                    continue
                stream = StreamGuard(HOLD_WHOLE_OUTPUT, 0)
                stream.feed(completion.text, len(completion.token_ids), None, final=True)
                self._streams[index] = stream
                outcome, release = await self.guards.check_stream(stream, self.context, final=True)
                record_outcome(self.record, outcome)
                self._final_checked.add(index)
                if release is None:
                    generation.filtered[index] = "content_filter"

    def screened(self, index: int, completion: CompletionOutput, filtered: dict[int, str]) -> CompletionOutput:
        """A whole-body choice as the guards leave it: filtered -> no text, no logprobs,
        finish_reason content_filter; redacted -> the redacted text without logprobs."""
        if index in filtered:
            return dataclasses.replace(completion, text="", logprobs=None, finish_reason=filtered[index],
                                       stop_reason=None)
        stream = self._streams.get(index)
        if stream is not None and stream.text() != completion.text and not stream.has_pending:
            return dataclasses.replace(completion, text=stream.text(), logprobs=None)
        return completion
