"""Proposers by ``--speculative`` method name (read-only)."""
from __future__ import annotations

from types import MappingProxyType

from kvserve.errors import InvalidRequestError
from kvserve.speculative.draft import build_draft_model, build_self_draft
from kvserve.speculative.ngram import build_ngram
from kvserve.speculative.proposer import ProposerEntry

PROPOSERS = MappingProxyType({
    "ngram": ProposerEntry(build_ngram),
    "self": ProposerEntry(build_self_draft),
    "draft": ProposerEntry(build_draft_model, draft_model_path=lambda spec: spec.draft_model),
})


def proposer_entry(method: str) -> ProposerEntry:
    """The entry registered under ``method``."""
    if method not in PROPOSERS:
        raise InvalidRequestError(f"unknown speculative method {method!r}; choose from {sorted(PROPOSERS)}",
                                  param="speculative")
    return PROPOSERS[method]
