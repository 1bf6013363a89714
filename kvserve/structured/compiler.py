"""Specs -> compiled grammars, once per distinct ``StructuredSpec`` (an LRU cache), with
compile times recorded and every failure turned into an ``InvalidRequestError``."""
from __future__ import annotations

import json
import threading
import time
from collections import OrderedDict

import xgrammar as xgr

from kvserve.engine.structured_spec import StructuredKind, StructuredSpec
from kvserve.errors import InvalidRequestError

# The request field a bad spec is reported against (the HTTP process names the exact one
# before the engine sees it; this is the engine's own word, for offline use).
PARAM_FOR_KIND = {
    StructuredKind.JSON_OBJECT: "response_format",
    StructuredKind.JSON_SCHEMA: "response_format.json_schema.schema",
    StructuredKind.REGEX: "guided_regex",
    StructuredKind.CHOICE: "guided_choice",
    StructuredKind.GRAMMAR: "guided_grammar",
}


def choice_grammar(choices: list[str]) -> str:
    """An EBNF grammar whose language is exactly ``choices``."""
    if not choices or not all(isinstance(c, str) and c for c in choices):
        raise ValueError("choice needs a non-empty list of non-empty strings")
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


class GrammarCache:
    """Compiles and caches grammars for one vocabulary (thread-safe)."""

    def __init__(self, info: "xgr.TokenizerInfo", max_entries: int = 512, max_threads: int = 1):
        self.info = info
        self.compiler = xgr.GrammarCompiler(info, max_threads=max_threads, cache_enabled=False)
        self.max_entries = max_entries
        self._cache: OrderedDict[StructuredSpec, xgr.CompiledGrammar] = OrderedDict()
        self._lock = threading.Lock()
        self.compile_times_s: list[float] = []      # one per compilation (cache misses)

    def get(self, spec: StructuredSpec) -> "xgr.CompiledGrammar":
        """The compiled grammar of ``spec`` (raises ``InvalidRequestError`` if it has none)."""
        with self._lock:
            hit = self._cache.get(spec)
            if hit is not None:
                self._cache.move_to_end(spec)
                return hit
        started = time.perf_counter()
        try:
            compiled = self._compile(spec)
        except Exception as exc:        # a user's spec xgrammar cannot compile, for whatever reason
            raise InvalidRequestError(f"the {spec.kind.value} constraint cannot be compiled: {exc}",
                                      param=PARAM_FOR_KIND[spec.kind]) from exc
        with self._lock:
            self.compile_times_s.append(time.perf_counter() - started)
            self._cache[spec] = compiled
            while len(self._cache) > self.max_entries:
                self._cache.popitem(last=False)
        return compiled

    def _compile(self, spec: StructuredSpec) -> "xgr.CompiledGrammar":
        kind = spec.kind
        if kind is StructuredKind.JSON_OBJECT:
            return self.compiler.compile_json_schema('{"type": "object"}', any_whitespace=False)
        if kind is StructuredKind.JSON_SCHEMA:
            schema = json.loads(spec.value)
            if not isinstance(schema, dict):
                raise ValueError("a JSON schema must be an object")
            # compact JSON, no free whitespace: a model cannot pad forever, the grammar ends
            return self.compiler.compile_json_schema(spec.value, any_whitespace=False, strict_mode=True)
        if kind is StructuredKind.REGEX:
            return self.compiler.compile_regex(spec.value)
        if kind is StructuredKind.CHOICE:
            return self.compiler.compile_grammar(choice_grammar(json.loads(spec.value)))
        return self.compiler.compile_grammar(spec.value)
