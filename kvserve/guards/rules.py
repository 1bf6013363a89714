"""The rules guard: word lists, regular expressions and personal-data detectors.

One pass of one compiled regular expression finds the built-in detectors and the word
list together (each alternative a named group); each configured pattern is one more
pass. Card numbers are Luhn-checked, so a random run of digits does not trip it.

Detectors (``PII_DETECTORS``):

- ``email``: ``local@domain.tld``;
- ``card``: 13-19 digits, optionally grouped by single spaces or dashes, Luhn-valid;
- ``api_key``: OpenAI-style ``sk-...``, AWS ``AKIA...``/``ASIA...``, GitHub ``ghp_``/``gho_``/
  ``ghu_``/``ghs_``/``ghr_``/``github_pat_``, Slack ``xox?-...``, Google ``AIza...``, a PEM
  private-key block, and ``api_key = <16+ character token>`` style assignments (the
  value only is redacted);
- ``ssn``: US social security numbers written ``123-45-6789``;
- ``phone``: North-American numbers written with separators (``(555) 123-4567``,
  ``+1 555-123-4567``).

Action ``block`` refuses the text; ``redact`` replaces each match by ``[REDACTED:label]``.
"""
from __future__ import annotations

import asyncio
import re
from typing import Iterable, Sequence

from kvserve.guards.base import GuardContext, GuardPoint, Span, Verdict

_EMAIL = r"(?<![A-Za-z0-9._%+-])[A-Za-z0-9._%+-]{1,64}@[A-Za-z0-9](?:[A-Za-z0-9-]{0,62}[A-Za-z0-9])?" \
         r"(?:\.[A-Za-z0-9](?:[A-Za-z0-9-]{0,62}[A-Za-z0-9])?)*\.[A-Za-z]{2,24}(?![A-Za-z0-9-])"
_CARD = r"(?<![\d-])\d(?:[ -]?\d){12,18}(?![\d])"
_API_KEY = "|".join([
    r"\bsk-(?:proj-|ant-|live-|test-)?[A-Za-z0-9_-]{20,}",
    r"\b(?:AKIA|ASIA)[0-9A-Z]{16}\b",
    r"\bgh[pousr]_[A-Za-z0-9]{36,}",
    r"\bgithub_pat_[A-Za-z0-9_]{22,}",
    r"\bxox[abposr]-[A-Za-z0-9-]{10,}",
    r"\bAIza[0-9A-Za-z_-]{35}",
    r"-----BEGIN (?:[A-Z0-9]+ )*PRIVATE KEY-----(?:[\s\S]{0,16384}?-----END (?:[A-Z0-9]+ )*PRIVATE KEY-----)?",
])
_GENERIC_KEY = (r"(?i:\b(?:api[_-]?key|secret[_-]?key|access[_-]?key|access[_-]?token|auth[_-]?token|"
                r"client[_-]?secret|password|passwd|secret|token)\b[\"']?\s*[:=]\s*[\"']?)"
                r"(?P<generic_value>[A-Za-z0-9_\-+/.=]{16,})")
_SSN = r"(?<![\d-])(?!000|666|9\d\d)\d{3}-(?!00)\d{2}-(?!0000)\d{4}(?![\d-])"
_PHONE = r"(?<![\w+])(?:\+?1[ .-]?)?(?:\(\d{3}\)\s?|\d{3}[ .-])\d{3}[ .-]\d{4}(?![\d-])"

PII_DETECTORS: dict[str, str] = {
    "email": _EMAIL,
    "card": _CARD,
    "api_key": f"(?:{_API_KEY})|{_GENERIC_KEY}",
    "ssn": _SSN,
    "phone": _PHONE,
}
ACTIONS = ("block", "redact")
THREAD_CHARS = 65536          # texts longer than this are scanned in a worker thread


def luhn_valid(digits: str) -> bool:
    """The Luhn checksum of a string of digits (every second digit from the right doubled)."""
    total = 0
    for i, ch in enumerate(reversed(digits)):
        d = ord(ch) - 48
        if i % 2:
            d = d * 2 - 9 if d > 4 else d * 2
        total += d
    return total % 10 == 0


def card_span(text: str, start: int, end: int) -> tuple[int, int] | None:
    """The longest Luhn-valid run of 13-19 digits in ``text[start:end]`` made of whole
    groups (digits between separators), or None. A longer digit sequence that holds a
    card number plus other groups still finds the card."""
    groups = [(m.start() + start, m.end() + start) for m in re.finditer(r"\d+", text[start:end])]
    best: tuple[int, int] | None = None
    for i in range(len(groups)):
        digits = ""
        for j in range(i, len(groups)):
            digits += text[groups[j][0]:groups[j][1]]
            if len(digits) > 19:
                break
            if len(digits) >= 13 and digits.strip("0") and luhn_valid(digits):
                if best is None or groups[j][1] - groups[i][0] > best[1] - best[0]:
                    best = (groups[i][0], groups[j][1])
    return best


def words_pattern(words: Iterable[str]) -> str | None:
    """One case-insensitive alternation matching any of ``words`` as a whole word (not
    inside a longer word); None for no words."""
    unique = sorted({w.strip() for w in words if w.strip()}, key=lambda w: (-len(w), w))
    if not unique:
        return None
    return r"(?<!\w)(?i:" + "|".join(re.escape(w) for w in unique) + r")(?!\w)"


class RulesGuard:
    """Words, patterns and PII detectors; ``action`` "block" or "redact".

    ``words``: whole words or phrases, case-insensitive. ``patterns``: regular
    expressions (Python syntax, compiled once; flags inline, e.g. ``(?i)``). ``pii``:
    names from ``PII_DETECTORS``. Raises ValueError for an unknown detector or action
    and ``re.error`` for a pattern that does not compile.
    """

    def __init__(self, name: str = "rules", *, words: Sequence[str] = (), patterns: Sequence[str] = (),
                 pii: Sequence[str] = (), action: str = "block",
                 points: Iterable[GuardPoint] = tuple(GuardPoint)):
        unknown = [p for p in pii if p not in PII_DETECTORS]
        if unknown:
            raise ValueError(f"unknown PII detector {unknown[0]!r}; expected one of {', '.join(PII_DETECTORS)}")
        if action not in ACTIONS:
            raise ValueError(f'action: expected "block" or "redact", got {action!r}')
        self.name, self.action, self.points = name, action, frozenset(points)
        alternatives = [f"(?P<{label}>{PII_DETECTORS[label]})" for label in dict.fromkeys(pii)]
        words_re = words_pattern(words)
        if words_re is not None:
            alternatives.append(f"(?P<word>{words_re})")      # after the detectors: an email wins over a word
        self._combined = re.compile("|".join(alternatives)) if alternatives else None
        self._patterns = [re.compile(p) for p in patterns]

    def find(self, text: str) -> list[Span]:
        """Every match in ``text`` as spans (unmerged, in order of discovery)."""
        spans: list[Span] = []
        if self._combined is not None:
            for m in self._combined.finditer(text):
                span = self._span(text, m)
                if span is not None:
                    spans.append(span)
        for pattern in self._patterns:
            spans.extend(Span(m.start(), m.end(), "pattern") for m in pattern.finditer(text) if m.end() > m.start())
        return spans

    @staticmethod
    def _span(text: str, m: re.Match) -> Span | None:
        label = m.lastgroup                       # the outermost named group: a detector or "word"
        if label == "card":
            found = card_span(text, m.start(), m.end())
            return Span(found[0], found[1], "card") if found else None
        if label == "api_key" and m.group("generic_value") is not None:     # the assignment's value only
            return Span(m.start("generic_value"), m.end("generic_value"), "api_key")
        return Span(m.start(), m.end(), label)

    def verdict(self, text: str) -> Verdict:
        """The verdict on ``text`` (synchronous; ``check`` is its async form)."""
        spans = self.find(text)
        if not spans:
            return Verdict.allow()
        labels = tuple(dict.fromkeys(s.label for s in spans))
        if self.action == "redact":
            return Verdict.redact(spans, "redacted " + ", ".join(labels))
        return Verdict.block("the text contains " + ", ".join(labels), labels)

    async def check(self, text: str, context: GuardContext) -> Verdict:
        """``verdict(text)``; in a worker thread when the text is long (the loop keeps serving)."""
        if len(text) > THREAD_CHARS:
            return await asyncio.to_thread(self.verdict, text)
        return self.verdict(text)
