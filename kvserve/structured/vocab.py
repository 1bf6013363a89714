"""The engine's vocabulary as xgrammar sees it (``TokenizerInfo``).

GGUF and tokenizer.json vocabularies spell tokens in one of two ways: byte-level BPE
(GPT-2's printable byte alphabet, "Ġ" for a space) or SentencePiece with byte fallback
("▁" for a space, "<0x0A>" for a raw byte). Special and control tokens (chat markers
such as ``<|im_end|>``) are spelled as empty strings, so no grammar can produce them as
text; the stop tokens are passed separately and end the grammar.
"""
from __future__ import annotations

import re
from typing import Iterable

import xgrammar as xgr

_BYTE_TOKEN = re.compile(r"^<0x[0-9A-Fa-f]{2}>$")


def vocab_type(tokens: Iterable[str | None]) -> "xgr.VocabType":
    """BYTE_FALLBACK when the vocabulary has ``<0xNN>`` byte tokens and "▁" spaces, else BYTE_LEVEL."""
    has_bytes = has_sp_space = False
    for token in tokens:
        if token is None:
            continue
        has_bytes = has_bytes or bool(_BYTE_TOKEN.match(token))
        has_sp_space = has_sp_space or token.startswith("\u2581")
        if has_bytes and has_sp_space:
            return xgr.VocabType.BYTE_FALLBACK
    return xgr.VocabType.BYTE_LEVEL


def encoded_vocab(tokens: list[str | None], special_ids: Iterable[int]) -> list[str]:
    """The vocabulary with special tokens (and holes) as empty strings."""
    special = set(special_ids)
    return ["" if (token is None or i in special) else token for i, token in enumerate(tokens)]


def tokenizer_info(tokens: list[str | None], special_ids: Iterable[int], stop_token_ids: Iterable[int],
                   vocab_size: int) -> "xgr.TokenizerInfo":
    """``TokenizerInfo`` for a vocabulary of ``tokens`` (their spellings, index = id) padded to
    the model's ``vocab_size`` (the logits' width)."""
    kind = vocab_type(tokens)
    return xgr.TokenizerInfo(encoded_vocab(tokens, special_ids), kind, vocab_size=vocab_size,
                             stop_token_ids=sorted(set(stop_token_ids)),
                             add_prefix_space=kind == xgr.VocabType.BYTE_FALLBACK)


def tokenizer_info_from(tokenizer, vocab_size: int) -> "xgr.TokenizerInfo":
    """``TokenizerInfo`` from a ``kvserve.tokenizer.Tokenizer``."""
    tokens = tokenizer.convert_ids_to_tokens(range(min(tokenizer.vocab_size, vocab_size)))
    return tokenizer_info(tokens, tokenizer.all_special_ids | tokenizer.eos_token_ids,
                          tokenizer.eos_token_ids, vocab_size)
