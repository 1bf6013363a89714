"""Guards from plain tables (the tenants file's ``[guards.NAME]``), checked field by field.

    [guards.blockme]                      [guards.judge]
    type = "rules"                        type = "model"
    words = ["BLOCKME"]                   threshold = 0.0        # logprob margin that blocks
    patterns = ['(?i)secret\\s+plan']     adapter = "guard-lora" # optional: a loaded adapter
    pii = ["email", "card", "api_key"]    timeout_ms = 2000
    action = "redact"                     on_timeout = "open"
    points = ["input", "output"]

Fields every guard has: ``points`` (input / stream / output), ``timeout_ms``,
``on_timeout`` and ``on_error`` ("open" | "closed"; ``on_error`` defaults to
``on_timeout``), ``every_tokens`` and ``window_chars`` (the stream point's cadence and
window; a rules guard checks every delta by default, a model guard every 16 tokens). A table that cannot be used raises ValueError naming the field path
(``guards.pii.action: expected "block" or "redact", got 'mask'``).
"""
from __future__ import annotations

import math
import re
from typing import Callable, Mapping, Sequence

from kvserve.guards.base import GuardPoint
from kvserve.guards.model_guard import DEFAULT_INSTRUCTION, DEFAULT_LABELS, ModelGuard, PromptTemplate
from kvserve.guards.rules import ACTIONS, PII_DETECTORS, RulesGuard
from kvserve.guards.runner import FAIL_MODES, GuardSet, GuardSpec, Observer

COMMON_FIELDS = frozenset({"type", "points", "timeout_ms", "on_timeout", "on_error", "every_tokens", "window_chars"})
RULES_FIELDS = COMMON_FIELDS | {"words", "patterns", "pii", "action"}
MODEL_FIELDS = COMMON_FIELDS | {"threshold", "adapter", "instruction", "examples", "labels", "max_chars"}
DEFAULTS = {  # type -> (points, timeout_ms, every_tokens)
    "rules": (("input", "stream", "output"), 100, 1),     # microseconds a check: every delta, no added TTFT
    "model": (("input", "output"), 2000, 16),             # an engine request a check
}
ClassifierFactory = Callable[[str | None], object]   # adapter name (None: base model) -> Classifier


def build_guard_spec(name: str, table: Mapping, make_classifier: ClassifierFactory | None = None,
                     where: str | None = None) -> GuardSpec:
    """One guard from its table. ``make_classifier(adapter)`` gives a model guard its
    classifier (the server: an ``EngineClassifier``); ``where`` prefixes error paths
    (default ``guards.NAME``)."""
    where = where or f"guards.{name}"
    if not isinstance(table, Mapping):
        raise ValueError(f"{where}: expected a table, got {type(table).__name__}")
    kind = table.get("type")
    if kind not in DEFAULTS:
        raise ValueError(f'{where}.type: expected "rules" or "model", got {kind!r}')
    _no_unknown(table, RULES_FIELDS if kind == "rules" else MODEL_FIELDS, where)
    default_points, default_timeout_ms, default_every_tokens = DEFAULTS[kind]
    points = _points(table.get("points", default_points), f"{where}.points")
    guard = (_rules(name, table, points, where) if kind == "rules"
             else _model(name, table, points, make_classifier, where))
    timeout_ms = _number(table.get("timeout_ms", default_timeout_ms), f"{where}.timeout_ms", positive=True)
    on_timeout = _choice(table.get("on_timeout", "closed"), FAIL_MODES, f"{where}.on_timeout")
    on_error = _choice(table.get("on_error", on_timeout), FAIL_MODES, f"{where}.on_error")
    return GuardSpec(guard, points, timeout_ms / 1000.0, on_timeout, on_error,
                     _int(table.get("every_tokens", default_every_tokens), f"{where}.every_tokens", minimum=1),
                     _int(table.get("window_chars", 512), f"{where}.window_chars", minimum=0))


def build_guard_sets(guards: Mapping[str, Mapping], tenant_guards: Mapping[str, Sequence[str]],
                     make_classifier: ClassifierFactory | None = None,
                     observe: Observer | None = None) -> dict[str, GuardSet]:
    """tenant -> its ``GuardSet`` (tenants without guards are left out). Each guard is
    built once and shared (guards keep no text between calls); ``tenant_guards`` maps a
    tenant to the guard names it lists, in order."""
    built = {name: build_guard_spec(name, table, make_classifier) for name, table in guards.items()}
    sets = {}
    for tenant, names in tenant_guards.items():
        unknown = [n for n in names if n not in built]
        if unknown:
            raise ValueError(f"tenants.{tenant}.guards: no guard named {unknown[0]!r} under [guards]")
        if names:
            sets[tenant] = GuardSet([built[n] for n in dict.fromkeys(names)], observe)
    return sets


# ------------------------------------------------------------------ kinds
def _rules(name: str, table: Mapping, points: frozenset[GuardPoint], where: str) -> RulesGuard:
    words = _strings(table.get("words", []), f"{where}.words")
    patterns = _strings(table.get("patterns", []), f"{where}.patterns")
    for i, pattern in enumerate(patterns):
        try:
            re.compile(pattern)
        except re.error as exc:
            raise ValueError(f"{where}.patterns[{i}]: not a valid regular expression: {exc}") from None
    pii = _strings(table.get("pii", []), f"{where}.pii")
    for i, detector in enumerate(pii):
        _choice(detector, tuple(PII_DETECTORS), f"{where}.pii[{i}]")
    if not (words or patterns or pii):
        raise ValueError(f"{where}: a rules guard needs at least one of words, patterns or pii")
    action = _choice(table.get("action", "block"), ACTIONS, f"{where}.action")
    return RulesGuard(name, words=words, patterns=patterns, pii=pii, action=action, points=points)


def _model(name: str, table: Mapping, points: frozenset[GuardPoint], make_classifier: ClassifierFactory | None,
           where: str) -> ModelGuard:
    if make_classifier is None:
        raise ValueError(f"{where}.type: a model guard needs a model to ask; none is available here")
    adapter = table.get("adapter")
    if adapter is not None and (not isinstance(adapter, str) or not adapter):
        raise ValueError(f"{where}.adapter: expected an adapter name")
    labels = _strings(table.get("labels", [label.strip() for label in DEFAULT_LABELS]), f"{where}.labels")
    if len(labels) != 2:
        raise ValueError(f"{where}.labels: expected two labels [allowed, dangerous], got {len(labels)}")
    instruction = table.get("instruction", DEFAULT_INSTRUCTION)
    if not isinstance(instruction, str) or not instruction.strip():
        raise ValueError(f"{where}.instruction: expected a non-empty string")
    template = PromptTemplate(instruction, _examples(table, where), (" " + labels[0], " " + labels[1]),
                              _int(table.get("max_chars", 2000), f"{where}.max_chars", minimum=1))
    threshold = _number(table.get("threshold", 0.0), f"{where}.threshold")
    return ModelGuard(make_classifier(adapter), name, threshold=threshold, template=template, points=points)


def _examples(table: Mapping, where: str) -> tuple[tuple[str, bool], ...]:
    """``examples = [{text = "...", dangerous = true}, ...]`` (absent: the built-in ones)."""
    if "examples" not in table:
        return PromptTemplate().examples
    value = table["examples"]
    if not isinstance(value, list):
        raise ValueError(f"{where}.examples: expected a list of {{text, dangerous}} tables")
    examples = []
    for i, item in enumerate(value):
        if (not isinstance(item, Mapping) or set(item) != {"text", "dangerous"} or not isinstance(item["text"], str)
                or not isinstance(item["dangerous"], bool)):
            raise ValueError(f"{where}.examples[{i}]: expected {{text = \"...\", dangerous = true|false}}")
        examples.append((item["text"], item["dangerous"]))
    return tuple(examples)


# ----------------------------------------------------------------- fields
def _no_unknown(table: Mapping, known: frozenset[str], where: str) -> None:
    unknown = sorted(set(table) - known)
    if unknown:
        raise ValueError(f"{where}.{unknown[0]}: unknown field; expected one of {', '.join(sorted(known))}")


def _choice(value, choices: Sequence[str], where: str) -> str:
    if value not in choices:
        expected = " or ".join(f'"{c}"' for c in choices) if len(choices) <= 3 else ", ".join(choices)
        raise ValueError(f"{where}: expected {expected}, got {value!r}")
    return value


def _strings(value, where: str) -> list[str]:
    if not isinstance(value, list) or not all(isinstance(v, str) and v for v in value):
        raise ValueError(f"{where}: expected a list of non-empty strings")
    return value


def _points(value, where: str) -> frozenset[GuardPoint]:
    names = _strings(list(value) if isinstance(value, tuple) else value, where)
    if not names:
        raise ValueError(f"{where}: expected at least one of input, stream, output")
    for i, point in enumerate(names):
        _choice(point, tuple(p.value for p in GuardPoint), f"{where}[{i}]")
    return frozenset(GuardPoint(p) for p in names)


def _number(value, where: str, positive: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
            or (positive and value <= 0):
        raise ValueError(f"{where}: expected a {'positive ' if positive else ''}number, got {value!r}")
    return float(value)


def _int(value, where: str, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{where}: expected an integer >= {minimum}, got {value!r}")
    return value
