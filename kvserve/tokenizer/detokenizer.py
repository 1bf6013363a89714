"""Incremental detokenization with stop strings.

Generated ids arrive a few at a time; clients want text as soon as it is safe
to show. Two things make text unsafe to release yet:

1. A character whose UTF-8 bytes span tokens: until its last byte arrives the
   decode ends in U+FFFD. We hold text back while it does.
2. A possible start of a stop string: the longest suffix that is a prefix of a
   stop string is held until the next ids settle it.

Decoding uses a window instead of the whole output (the prefix/read offset
technique)::

    output ids:  [ ........ released ........ | prefix window | unread ids ]
                                    prefix_offset ^   read_offset ^

    delta = decode(ids[prefix_offset:]) minus decode(ids[prefix_offset:read_offset])

Both offsets sit on character boundaries, so each `add` decodes O(window) ids.
The prefix window gives decoders that treat a first token specially (SentencePiece
strips its leading space) the same context as in the full decode.

Invariant: the concatenation of every delta and `finish()` equals
``tokenizer.decode(output_ids)`` cut before the first occurrence of any stop
string (or after it with `include_stop_str_in_output`; at equal starts the
shortest stop string wins), however the ids are
split into `add` calls. Only output text is searched: a stop string that would
start in the prompt never matches, and the prompt never appears in the output.
"""
from __future__ import annotations

from dataclasses import dataclass

from kvserve.errors import InvalidRequestError

REPLACEMENT_CHAR = "\ufffd"


@dataclass
class DetokenizerDelta:
    """What one `IncrementalDetokenizer.add` call releases."""

    text: str  # new text, safe to send: no broken character, no possible stop-string start
    stopped: bool  # a stop string matched; nothing more will be released


class IncrementalDetokenizer:
    """Turns a request's generated ids into text deltas, watching for stop strings.

    One instance per request; not thread-safe. `text` is everything released so
    far; `stop_hit` is the stop string that matched, or None.
    """

    def __init__(self, tokenizer, prompt_token_ids: list[int], *, skip_special_tokens: bool = True,
                 stop: list[str] | tuple = (), include_stop_str_in_output: bool = False):
        """Start detokenizing the output of a request whose prompt was `prompt_token_ids`.

        The prompt is kept for reference only (`num_prompt_tokens`): the output text
        is decoded from output ids alone, so it equals what decoding the completion
        ids gives. Empty stop strings are ignored.
        """
        if isinstance(stop, str):
            stop = [stop]
        if not all(isinstance(s, str) for s in stop):
            raise InvalidRequestError("stop must be a string or a list of strings", param="stop")
        self._tokenizer = tokenizer
        self.num_prompt_tokens = len(prompt_token_ids)
        self._skip_special = skip_special_tokens
        self._stops = tuple(dict.fromkeys(s for s in stop if s))  # unique, in the caller's order
        self._include_stop = include_stop_str_in_output
        self._ids: list[int] = []  # output ids only
        self._prefix_offset = 0
        self._read_offset = 0
        self._held = ""  # decoded text held back as a possible stop-string start
        self._chunks: list[str] = []
        self.stop_hit: str | None = None

    @property
    def text(self) -> str:
        """All output text released so far (the concatenation of the deltas)."""
        if len(self._chunks) > 1:
            self._chunks = ["".join(self._chunks)]
        return self._chunks[0] if self._chunks else ""

    @property
    def stopped(self) -> bool:
        """Whether a stop string has matched."""
        return self.stop_hit is not None

    def add(self, token_ids: list[int]) -> DetokenizerDelta:
        """Feed newly generated ids; return the text that became safe to release.

        After a stop string matched, further ids are ignored and the delta is empty.
        """
        if self.stop_hit is not None:
            return DetokenizerDelta("", True)
        self._ids.extend(token_ids)
        new_text = self._decode_new(final=False)
        return self._release(new_text, final=False)

    def finish(self) -> str:
        """Flush held text when the request ends for another reason (EOS, length, abort).

        Returns the extra delta: text held for a broken character (decoded with
        U+FFFD, as a full decode would) and text held as a possible stop start.
        A stop string completed by the flushed text still truncates it.
        """
        if self.stop_hit is not None:
            return ""
        new_text = self._decode_new(final=True)
        return self._release(new_text, final=True).text

    # ----------------------------------------------------------------- internals
    def _decode(self, start: int, end: int | None = None) -> str:
        return self._tokenizer.decode(self._ids[start:end], skip_special_tokens=self._skip_special)

    def _decode_new(self, final: bool) -> str:
        """Text of ids past `read_offset`, once it ends on a whole character (or `final`)."""
        if self._read_offset == len(self._ids):
            return ""
        prefix_text = self._decode(self._prefix_offset, self._read_offset)
        window_text = self._decode(self._prefix_offset)
        if window_text.endswith(REPLACEMENT_CHAR) and not final:
            return ""  # a character is still incomplete: wait for its remaining bytes
        if window_text.startswith(prefix_text):
            new_text = window_text[len(prefix_text):]
        else:  # decoder not prefix-stable on this window: fall back to a full decode
            new_text = self._decode(0)[self._num_decoded_chars():]
        if not new_text and not final:
            return ""  # e.g. skipped special tokens: keep the window, so it keeps real text as context
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        return new_text

    def _num_decoded_chars(self) -> int:
        return len(self.text) + len(self._held)

    def _release(self, new_text: str, final: bool) -> DetokenizerDelta:
        """Search `held + new_text` for stop strings; release what is safe.

        A complete match is acted on only when no stop string could still start
        before it (a partial candidate earlier in the text waits for more ids), so
        the result does not depend on how ids are split into calls.
        """
        pending = self._held + new_text
        keep = 0 if final else self._stop_prefix_len(pending)
        safe_end = len(pending) - keep  # earliest start of a possible, incomplete stop string
        match_at, match = self._first_stop(pending)
        if match is not None and match_at <= safe_end:
            end = match_at + (len(match) if self._include_stop else 0)
            self.stop_hit = match
            self._held = ""
            return self._emit(pending[:end], stopped=True)
        self._held = pending[safe_end:]
        return self._emit(pending[:safe_end], stopped=False)

    def _emit(self, text: str, stopped: bool) -> DetokenizerDelta:
        if text:
            self._chunks.append(text)
        return DetokenizerDelta(text, stopped)

    def _first_stop(self, text: str) -> tuple[int, str | None]:
        """The earliest stop-string occurrence in `text`; at equal starts the shortest."""
        best_key, best = (len(text) + 1, 0), None
        for stop in self._stops:
            at = text.find(stop)
            if at >= 0 and (at, len(stop)) < best_key:
                best_key, best = (at, len(stop)), stop
        return best_key[0], best

    def _stop_prefix_len(self, text: str) -> int:
        """Length of the longest suffix of `text` that is a proper prefix of a stop string."""
        longest = 0
        for stop in self._stops:
            for size in range(min(len(stop) - 1, len(text)), longest, -1):
                if text.endswith(stop[:size]):
                    longest = size
                    break
        return longest
