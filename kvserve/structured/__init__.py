"""Structured output with xgrammar: the engine's ``ConstraintBackend``
(``kvserve/engine/constraint.py``) for JSON schemas, JSON objects, regexes, choices and
EBNF grammars. Imports torch (through xgrammar): never import it from the HTTP process.
"""
from kvserve.structured.backend import XGrammarBackend, build_constraint_backend

__all__ = ["XGrammarBackend", "build_constraint_backend"]
