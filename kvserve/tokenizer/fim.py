"""Fill in the middle (FIM): which FIM tokens a vocabulary declares, and the FIM prompt.

A code model trained for infilling sees ``prefix`` and ``suffix`` wrapped in three
control tokens and writes the middle. The layout is detected from the vocabulary
itself (never from a file name): a layout counts only when all three of its tokens
are single entries of the vocabulary, with three distinct ids.

- ``starcoder``: ``<fim_prefix>`` ``<fim_suffix>`` ``<fim_middle>`` (StarCoder, StarCoder2)
- ``qwen``: ``<|fim_prefix|>`` ``<|fim_suffix|>`` ``<|fim_middle|>`` (Qwen2.5-Coder)
- ``codellama``: ``▁<PRE>`` ``▁<SUF>`` ``▁<MID>``, or ``<PRE>`` ``<SUF>`` ``<MID>`` (CodeLlama)

The prompt is built in PSM order (prefix, suffix, middle)::

    [BOS if the tokenizer adds one to plain prompts] <prefix tok> encode(prefix)
    <suffix tok> encode(suffix) <middle tok>

with both pieces encoded without special tokens. For CodeLlama's documented
``<PRE> {prefix} <SUF>{suffix} <MID>`` this is the shape the Hugging Face fast tokenizer
builds (its infilling post-processor: BOS, prefix token, prefix, suffix token, suffix,
middle token): the spaces are carried by the ``▁`` of the control tokens and by the
tokenizer's own SentencePiece dummy prefix, which is not adjusted here.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from kvserve.errors import InvalidRequestError

# (layout name, what it is called in messages, spellings of (prefix, suffix, middle) tried in order)
FIM_LAYOUTS: tuple[tuple[str, str, tuple[tuple[str, str, str], ...]], ...] = (
    ("starcoder", "StarCoder", (("<fim_prefix>", "<fim_suffix>", "<fim_middle>"),)),
    ("qwen", "Qwen2.5-Coder", (("<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>"),)),
    ("codellama", "CodeLlama", (("▁<PRE>", "▁<SUF>", "▁<MID>"), ("<PRE>", "<SUF>", "<MID>"))),
)


class Vocabulary(Protocol):
    """What detection needs of a tokenizer (kvserve's Tokenizer has it)."""

    def token_to_id(self, token: str) -> int | None: ...


class FimTokenizer(Vocabulary, Protocol):
    """What building a FIM prompt needs of a tokenizer (kvserve's Tokenizer has it)."""

    add_bos: bool
    bos_token_id: int | None

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]: ...


@dataclass(frozen=True)
class FimTokens:
    """The FIM layout a vocabulary declares: its name (see FIM_LAYOUTS) and the three ids."""

    layout: str
    prefix_id: int
    suffix_id: int
    middle_id: int


def recognised_layouts() -> str:
    """The recognised layouts, for messages: ``StarCoder (<fim_prefix> ...), ...``."""
    return ", ".join(f"{title} ({' '.join(spellings[0])})" for _name, title, spellings in FIM_LAYOUTS)


def detect_fim(vocab: Vocabulary, vocab_size: int | None = None) -> FimTokens | None:
    """The first layout of FIM_LAYOUTS whose three tokens are all single vocabulary entries
    (distinct ids, below ``vocab_size`` when given); None when the vocabulary has none."""
    for name, _title, spellings in FIM_LAYOUTS:
        for spelling in spellings:
            ids = [vocab.token_to_id(token) for token in spelling]
            if any(i is None for i in ids) or len(set(ids)) != 3:
                continue
            if vocab_size is not None and max(ids) >= vocab_size:
                continue
            return FimTokens(name, *ids)
    return None


def build_fim_prompt(tokenizer: FimTokenizer, fim: FimTokens, prefix: str, suffix: str) -> list[int]:
    """The FIM prompt's token ids in PSM order (see the module docstring).

    BOS leads only when the tokenizer adds BOS to plain prompts; EOS is never appended
    (the middle token must be last). Special-token texts inside ``prefix`` or ``suffix``
    map to their ids, as they do in plain prompts.
    """
    bos = [tokenizer.bos_token_id] if tokenizer.add_bos and tokenizer.bos_token_id is not None else []
    return [*bos, fim.prefix_id, *tokenizer.encode(prefix, add_special_tokens=False),
            fim.suffix_id, *tokenizer.encode(suffix, add_special_tokens=False), fim.middle_id]


def require_fim(fim: FimTokens | None, model: str | None = None) -> FimTokens:
    """``fim`` itself, or InvalidRequestError(param="suffix") when the model has no FIM tokens."""
    if fim is None:
        name = f"the model {model!r}" if model else "this model"
        raise InvalidRequestError(
            f"suffix is not supported: {name} has no fill-in-the-middle tokens in its vocabulary "
            f"(recognised layouts: {recognised_layouts()})", param="suffix")
    return fim
