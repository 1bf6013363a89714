"""OpenAI response bodies: completions and chat, whole or as stream chunks; logprobs; usage.

Pure functions of outputs and deltas; the tokenizer is used only to spell tokens.
"""
from __future__ import annotations

import codecs
import json
import math
import re
import time
from functools import lru_cache

from kvserve.frontend.outputs import CompletionOutput
from kvserve.server.tool_parser import ToolCallStream, final_message
from kvserve.server.tools import ToolConfig

NEG_INF_LOGPROB = -9999.0      # JSON has no -Infinity: a token with no mass reports this


def sse(payload: dict | str) -> bytes:
    """One server-sent event."""
    data = payload if isinstance(payload, str) else json.dumps(payload, ensure_ascii=False,
                                                                separators=(",", ":"))
    return f"data: {data}\n\n".encode("utf-8")


SSE_DONE = b"data: [DONE]\n\n"


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict:
    """OpenAI ``usage``; ``cached_tokens``: prompt tokens the prefix cache served."""
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


def _finite(lp: float) -> float:
    return lp if math.isfinite(lp) else NEG_INF_LOGPROB


@lru_cache(maxsize=1)
def _byte_decoder() -> dict[str, int]:
    """GPT-2 byte-level BPE: vocabulary character -> byte."""
    printable = (list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
                 + list(range(ord("®"), ord("ÿ") + 1)))
    chars, extra = list(printable), 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(printable, chars)}


_BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")     # SentencePiece byte fallback


def _raw_bytes(piece: str, text: str) -> list[int]:
    """A token's bytes: from its byte-level BPE piece, its ``<0xNN>`` byte-fallback piece,
    else its decoded text."""
    byte_piece = _BYTE_PIECE.fullmatch(piece)
    if byte_piece:
        return [int(byte_piece.group(1), 16)]
    decoder = _byte_decoder()
    if piece and all(c in decoder for c in piece):
        return [decoder[c] for c in piece]
    return list(text.encode("utf-8"))


def spell_bytes(raw: list[int]) -> str:
    """How logprobs spell a token that is not whole UTF-8 (a piece of a character, as an
    emoji's byte-fallback tokens are): ``bytes:\\xf0\\x9f``, as vLLM does. Such spellings stay
    distinct (as ``top_logprobs`` keys) and join back to the text: concatenate the bytes."""
    return "bytes:" + "".join(f"\\x{b:02x}" for b in raw)


class TokenSpeller:
    """Token id -> its text and raw bytes, as logprobs report them; a token whose bytes are
    not whole UTF-8 is spelled ``bytes:\\xNN...`` (``spell_bytes``)."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self._cache: dict[int, tuple[str, list[int]]] = {}
        self._hidden: dict[int, bool] = {}

    def spell(self, token_id: int) -> tuple[str, list[int]]:
        hit = self._cache.get(token_id)
        if hit is None:
            text = self.tokenizer.decode([token_id], skip_special_tokens=False)
            raw = _raw_bytes(self.tokenizer.convert_ids_to_tokens([token_id])[0] or "", text)
            try:
                bytes(raw).decode("utf-8")
            except UnicodeDecodeError:
                text = spell_bytes(raw)
            hit = self._cache[token_id] = (text, raw)
            if len(self._cache) > 200_000:
                self._cache.clear()
        return hit

    def hidden(self, token_id: int) -> bool:
        """Whether the token leaves no text when special tokens are skipped (an end-of-turn token)."""
        hit = self._hidden.get(token_id)
        if hit is None:
            hit = self._hidden[token_id] = self.tokenizer.decode([token_id], skip_special_tokens=True) == ""
            if len(self._hidden) > 200_000:
                self._hidden.clear()
        return hit


def _top(entry: dict[int, float], k: int) -> list[tuple[int, float]]:
    return sorted(entry.items(), key=lambda kv: -kv[1])[:k]


def completion_logprobs(speller: TokenSpeller, token_ids: list[int], entries: list[dict[int, float] | None],
                        k: int, text_offset: int) -> dict:
    """The legacy completions ``logprobs`` object for these tokens (an entry of None,
    the first echoed prompt token's, reports null logprobs). A token's ``text_offset``
    counts the characters its predecessors' bytes complete."""
    tokens, token_lps, tops, offsets = [], [], [], []
    utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
    for token_id, entry in zip(token_ids, entries):
        text, raw = speller.spell(token_id)
        tokens.append(text)
        token_lps.append(_finite(entry[token_id]) if entry is not None else None)
        tops.append({speller.spell(t)[0]: _finite(lp) for t, lp in _top(entry, k)}
                    if k and entry is not None else None)
        offsets.append(text_offset)
        text_offset += len(utf8.decode(bytes(raw)))
    return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops, "text_offset": offsets}


def chat_logprobs(speller: TokenSpeller, token_ids: list[int], entries: list[dict[int, float]], k: int) -> dict:
    """The chat ``logprobs`` object (``{"content": [...]}``) for these tokens."""
    content = []
    for token_id, entry in zip(token_ids, entries):
        text, raw = speller.spell(token_id)
        top = []
        for t, lp in _top(entry, k):
            t_text, t_raw = speller.spell(t)
            top.append({"token": t_text, "logprob": _finite(lp), "bytes": t_raw})
        content.append({"token": text, "logprob": _finite(entry[token_id]), "bytes": raw, "top_logprobs": top})
    return {"content": content}


class ResponseBuilder:
    """Builds the bodies of one request: same id, created time, model and ``service_tier``
    (the tier of the class the request ran in; None: the field is left out) throughout.
    ``skip_special_tokens`` is the request's: chat logprobs leave out the end-of-turn token
    exactly when the content does (``_shown``). With ``return_token_ids`` (vLLM's extension)
    each choice carries its ``token_ids`` (streamed: each chunk its new ones) and the prompt's
    ``prompt_token_ids`` go on the completions choice, or on the chat body (streamed: with a
    choice's first chunk)."""

    def __init__(self, kind: str, request_id: str, model: str, speller: TokenSpeller, logprobs: int | None,
                 n: int, service_tier: str | None = None, tools: ToolConfig | None = None,
                 skip_special_tokens: bool = True, return_token_ids: bool = False):
        self.kind, self.id, self.model = kind, request_id, model
        self.return_token_ids = return_token_ids
        self.skip_special_tokens = skip_special_tokens
        self.tools = tools                               # chat tool calling: messages carry tool_calls
        self._tool_streams: dict[int, ToolCallStream] = {}
        self.service_tier = service_tier
        self.created = int(time.time())
        self.speller, self.logprobs, self.n = speller, logprobs, n
        self._text_offsets: dict[int, int] = {}

    def choice_index(self, prompt_index: int, completion_index: int) -> int:
        return prompt_index * self.n + completion_index

    def _shown(self, token_ids: list[int], finish_reason: str | None, stop_reason) -> list[int]:
        """The chat tokens whose logprobs are reported: all but a final stop token (EOS or a
        stop_token_ids match) that left no text in the content, as vLLM does."""
        if (finish_reason == "stop" and token_ids and not isinstance(stop_reason, str)
                and self.skip_special_tokens and self.speller.hidden(token_ids[-1])):
            return token_ids[:-1]
        return token_ids

    def _head(self, object_name: str) -> dict:
        head = {"id": self.id, "object": object_name, "created": self.created, "model": self.model}
        if self.service_tier is not None:
            head["service_tier"] = self.service_tier
        return head

    # ------------------------------------------------------------ whole bodies
    def completion_choice(self, index: int, completion: CompletionOutput, prefix: str = "",
                          echo_logprobs: dict | None = None, prompt_ids: list[int] | None = None) -> dict:
        """One whole completions choice; ``echo_logprobs`` (from :meth:`echo_logprobs`)
        leads the logprobs when the prompt is echoed; ``prompt_ids``: its prompt's ids."""
        logprobs = None
        if self.logprobs is not None and completion.logprobs is not None:
            logprobs = completion_logprobs(self.speller, completion.token_ids, completion.logprobs,
                                           self.logprobs, len(prefix))
            if echo_logprobs is not None:
                logprobs = {key: echo_logprobs[key] + logprobs[key] for key in logprobs}
        choice = {"index": index, "text": prefix + completion.text, "logprobs": logprobs,
                  "finish_reason": completion.finish_reason, "stop_reason": completion.stop_reason}
        return self._with_ids(choice, choice, completion.token_ids, prompt_ids)

    def _with_ids(self, body: dict, choice: dict, token_ids: list[int], prompt_ids: list[int] | None) -> dict:
        """``body`` with ``choice`` (one of its choices, or itself) carrying ``token_ids`` and,
        when given, the prompt's ids, if the request asked for them."""
        if self.return_token_ids:
            choice["token_ids"] = list(token_ids)
            if prompt_ids is not None:
                (choice if self.kind == "completion" else body)["prompt_token_ids"] = list(prompt_ids)
        return body

    def with_token_ids(self, chunk: dict, token_ids: list[int], prompt_ids: list[int] | None = None) -> dict:
        """A streamed chunk (of one choice) carrying its new ``token_ids`` and, on a choice's
        first chunk (``prompt_ids`` given), the prompt's, if the request asked for them."""
        return self._with_ids(chunk, chunk["choices"][0], token_ids, prompt_ids)

    def echo_logprobs(self, prompt_token_ids: list[int], entries: list | None) -> dict | None:
        """The echoed prompt's part of a completions ``logprobs`` object (text offsets from 0)."""
        if self.logprobs is None or entries is None:
            return None
        return completion_logprobs(self.speller, prompt_token_ids, entries, self.logprobs, 0)

    def chat_choice(self, index: int, completion: CompletionOutput) -> dict:
        logprobs = None
        if self.logprobs is not None and completion.logprobs is not None:
            shown = self._shown(completion.token_ids, completion.finish_reason, completion.stop_reason)
            logprobs = chat_logprobs(self.speller, shown, completion.logprobs[:len(shown)], self.logprobs)
        message, finish_reason = {"role": "assistant", "content": completion.text}, completion.finish_reason
        if self.tools is not None:
            message, finish_reason = final_message(self.tools, completion.text, finish_reason)
        choice = {"index": index, "message": message, "logprobs": logprobs, "finish_reason": finish_reason,
                  "stop_reason": completion.stop_reason}
        return self._with_ids(choice, choice, completion.token_ids, None)

    def full(self, choices: list[dict], prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0,
             prompt_ids: list[int] | None = None) -> dict:
        """The whole body; ``prompt_ids``: a chat request's prompt (its ``prompt_token_ids``)."""
        name = "text_completion" if self.kind == "completion" else "chat.completion"
        body = self._head(name)
        body["choices"] = sorted(choices, key=lambda c: c["index"])
        body["usage"] = usage(prompt_tokens, completion_tokens, cached_tokens)
        if self.return_token_ids and self.kind == "chat" and prompt_ids is not None:
            body["prompt_token_ids"] = list(prompt_ids)
        return body

    # ------------------------------------------------------------------ chunks
    def chunk(self, index: int, text: str, token_ids: list[int] | None = None,
              logprob_entries: list | None = None, finish_reason: str | None = None,
              stop_reason=None, role: bool = False) -> dict:
        """One streamed choice update (an echoed prompt is one with its prompt's entries)."""
        logprobs = None
        if self.logprobs is not None and logprob_entries is not None and token_ids:
            if self.kind == "completion":
                offset = self._text_offsets.get(index, 0)
                logprobs = completion_logprobs(self.speller, token_ids, logprob_entries, self.logprobs, offset)
            else:
                shown = self._shown(token_ids, finish_reason, stop_reason)
                if shown:                       # a last chunk holding only the end-of-turn token: none
                    logprobs = chat_logprobs(self.speller, shown, logprob_entries[:len(shown)], self.logprobs)
        self._text_offsets[index] = self._text_offsets.get(index, 0) + len(text)
        if self.kind == "completion":
            choice = {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}
            body = self._head("text_completion")
        elif self.tools is not None:
            delta, finish_reason = self._tool_delta(index, text, finish_reason, role)
            body = self._head("chat.completion.chunk")
            choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}
        else:
            delta = {"role": "assistant", "content": text} if role else ({"content": text} if text else {})
            choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}
            body = self._head("chat.completion.chunk")
        if finish_reason is not None:
            choice["stop_reason"] = stop_reason
        body["choices"] = [choice]
        return body

    def _tool_delta(self, index: int, text: str, finish_reason: str | None, role: bool) -> tuple[dict, str | None]:
        """A tool-calling choice's delta: content and tool-call deltas (tool_parser.py). Content
        goes only when there is some (a message that only calls has null content), but a
        choice that ends without either sends ``""``, as its whole message has."""
        stream = self._tool_streams.setdefault(index, ToolCallStream(self.tools))
        # a guard's or a drain's end does not flush held-back text (it may be what was stopped)
        final = finish_reason in ("stop", "length")
        content, calls = stream.feed(text, final=final)
        delta: dict = {"role": "assistant"} if role else {}
        if content or (final and not stream.called and not stream.sent_content):
            delta["content"] = content
        if calls:
            delta["tool_calls"] = calls
        return delta, stream.finish_reason(finish_reason)

    def usage_chunk(self, prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict:
        name = "text_completion" if self.kind == "completion" else "chat.completion.chunk"
        body = self._head(name)
        body["choices"] = []
        body["usage"] = usage(prompt_tokens, completion_tokens, cached_tokens)
        return body
