"""What a request's output must match (structured output), as the engine receives it.

The HTTP process turns ``response_format`` / ``tools`` / ``guided_*`` into one
``StructuredSpec``; the engine compiles it (once per distinct spec) into a token mask
that the sampler applies each step. The type is plain data so it crosses the IPC codec.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass


class StructuredKind(str, enum.Enum):
    """The kind of constraint; ``StructuredSpec.value`` is spelled accordingly."""

    JSON_OBJECT = "json_object"   # any JSON object; value is ""
    JSON_SCHEMA = "json_schema"   # value: the JSON schema as JSON text
    REGEX = "regex"               # value: the regular expression
    CHOICE = "choice"             # value: a JSON list of the allowed strings
    GRAMMAR = "grammar"           # value: an EBNF grammar


@dataclass(frozen=True)
class StructuredSpec:
    """One output constraint: its kind and its text (see ``StructuredKind``)."""

    kind: StructuredKind
    value: str = ""

    def to_wire(self) -> list:
        return [self.kind.value, self.value]

    @classmethod
    def from_wire(cls, raw: list) -> "StructuredSpec":
        kind, value = raw
        return cls(StructuredKind(kind), str(value))
