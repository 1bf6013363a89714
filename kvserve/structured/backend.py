"""``XGrammarBackend``: the engine's ``ConstraintBackend`` on xgrammar."""
from __future__ import annotations

import torch
import xgrammar as xgr

from kvserve.engine.structured_spec import StructuredSpec
from kvserve.structured.compiler import GrammarCache
from kvserve.structured.vocab import tokenizer_info_from

_BITS = torch.arange(32, dtype=torch.int32)


class XGrammarMatcher:
    """One sequence's ``xgr.GrammarMatcher`` behind the engine's ``TokenMatcher``."""

    def __init__(self, compiled: "xgr.CompiledGrammar", stop_token_ids: frozenset[int]):
        stops = sorted(stop_token_ids) or None
        self._matcher = xgr.GrammarMatcher(compiled, override_stop_tokens=stops)   # rollback: unlimited

    def fill_mask(self, bitmask: torch.Tensor, row: int) -> None:
        self._matcher.fill_next_token_bitmask(bitmask, row)

    def accept(self, token_id: int) -> bool:
        if self._matcher.is_terminated():
            return False
        return bool(self._matcher.accept_token(int(token_id)))

    def rollback(self, num_tokens: int) -> None:
        self._matcher.rollback(num_tokens)

    def is_terminated(self) -> bool:
        return self._matcher.is_terminated()


def unpack_bitmask(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """xgrammar's packed int32 bitmask ``[rows, ceil(V / 32)]`` -> bool ``[rows, V]``."""
    bits = (bitmask[:, :, None] >> _BITS) & 1                               # [rows, W, 32]
    return bits.reshape(bitmask.shape[0], -1)[:, :vocab_size].bool()


class XGrammarBackend:
    """Compiles specs once (``GrammarCache``) and makes matchers and masks for one vocabulary."""

    def __init__(self, info: "xgr.TokenizerInfo", vocab_size: int):
        self.vocab_size = vocab_size
        self.grammars = GrammarCache(info)

    def validate(self, spec: StructuredSpec) -> None:
        self.grammars.get(spec)

    def new_matcher(self, spec: StructuredSpec, stop_token_ids: frozenset[int]) -> XGrammarMatcher:
        return XGrammarMatcher(self.grammars.get(spec), stop_token_ids)

    def allocate_mask(self, num_rows: int) -> torch.Tensor:
        return xgr.allocate_token_bitmask(num_rows, self.vocab_size)

    def to_bool(self, bitmask: torch.Tensor, device) -> torch.Tensor:
        return unpack_bitmask(bitmask, self.vocab_size).to(device, non_blocking=True)


def build_constraint_backend(tokenizer, vocab_size: int) -> XGrammarBackend:
    """The backend for a model whose logits are ``vocab_size`` wide and whose tokens
    ``tokenizer`` (a ``kvserve.tokenizer.Tokenizer``) spells."""
    return XGrammarBackend(tokenizer_info_from(tokenizer, vocab_size), vocab_size)
