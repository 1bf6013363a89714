"""Build a `tokenizers.Tokenizer` from the tokenizer metadata of a GGUF file.

A GGUF carries no tokenizer.json: it stores llama.cpp's description of the
tokenizer (``tokenizer.ggml.*``). For byte-level BPE vocabularies
(``tokenizer.ggml.model == "gpt2"``) that is:

- ``tokens``: the vocabulary, id = position, spelled in the GPT-2 byte alphabet;
- ``token_type``: 1 normal, 3 control (special), 4 user-defined (added, not special);
- ``merges``: ``"left right"`` strings, best first;
- ``pre``: the name of the pre-tokenizer, which fixes how text is cut into words
  before BPE. We follow llama.cpp (``llama-vocab.cpp``): each name maps to a list
  of regexes applied one after the other, every match isolated, which is exactly a
  ``Sequence`` of ``Split(..., "isolated")`` pre-tokenizers.

Only byte-level BPE is supported; other tokenizer models raise ModelLoadError.
"""
from __future__ import annotations

import struct
import warnings
from dataclasses import dataclass, field

from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers
from tokenizers import Tokenizer as BackendTokenizer

from kvserve.errors import ModelLoadError
from kvserve.loader.gguf_file import read_gguf_metadata

TOKEN_TYPE_CONTROL = 3
TOKEN_TYPE_USER_DEFINED = 4

# GPT-2's regex, which `ByteLevel(use_regex=True)` applies by itself.
_GPT2 = None
_DIGIT = r"\p{N}"
_LLAMA3 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
           r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
          r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_GPT4O = (r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
          r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
          r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_TEKKEN = (r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
           r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
           r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")

# llama.cpp pre-tokenizer name -> regexes applied in order (None = the GPT-2 regex).
PRE_TOKENIZER_SPLITS: dict[str, tuple[str | None, ...]] = {
    "gpt2": (_GPT2,), "mpt": (_GPT2,), "olmo": (_GPT2,), "jais": (_GPT2,),
    "default": (r"[\p{P}\$\+<=>\^~\|]+", _GPT2, r"\p{N}+", r"[0-9][0-9][0-9]"),
    # SmolLM / StarCoder family: every digit on its own, then GPT-2.
    "smollm": (_DIGIT, _GPT2), "starcoder": (_DIGIT, _GPT2), "refact": (_DIGIT, _GPT2),
    "command-r": (_DIGIT, _GPT2), "codeshell": (_DIGIT, _GPT2), "exaone": (_DIGIT, _GPT2),
    "minerva-7b": (_DIGIT, _GPT2),
    "llama-bpe": (_LLAMA3,), "llama3": (_LLAMA3,), "llama-v3": (_LLAMA3,), "dbrx": (_LLAMA3,),
    "smaug-bpe": (_LLAMA3,), "falcon3": (_LLAMA3,), "pixtral": (_LLAMA3,), "chatglm-bpe": (_LLAMA3,),
    "qwen2": (_QWEN2,), "stablelm2": (_QWEN2,), "deepseek-r1-qwen": (_QWEN2,), "hunyuan": (_QWEN2,),
    "gpt-4o": (_GPT4O,), "llama4": (_GPT4O,), "minimax-m2": (_GPT4O,),
    "tekken": (_TEKKEN,),
}
# llama.cpp matches whole words against the vocabulary before merging for these.
IGNORE_MERGES_PRE = frozenset({"llama-bpe", "llama3", "llama-v3"})


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character table."""
    printable = (list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
                 + list(range(ord("®"), ord("ÿ") + 1)))
    table, extra = {}, 0
    for byte in range(256):
        if byte in printable:
            table[byte] = chr(byte)
        else:
            table[byte] = chr(256 + extra)
            extra += 1
    return table


@dataclass(frozen=True)
class GGUFTokenizerMetadata:
    """The ``tokenizer.*`` keys of a GGUF file, with llama.cpp's meanings."""

    model: str
    pre: str | None
    tokens: list[str]
    token_types: list[int]
    merges: list
    bos_token_id: int | None = None
    eos_token_id: int | None = None
    extra_eos_ids: frozenset[int] = field(default_factory=frozenset)  # eot / eom ids
    add_bos: bool = False
    add_eos: bool = False
    chat_template: str | None = None


def read_gguf_tokenizer_metadata(path: str) -> GGUFTokenizerMetadata:
    """Read the tokenizer metadata of the GGUF at `path` (raises ModelLoadError)."""
    try:
        fields = read_gguf_metadata(path, prefix="tokenizer.")
    except (OSError, ValueError, struct.error) as exc:
        raise ModelLoadError(f"cannot read GGUF file {path!r}: {exc}") from exc

    def get(key, default=None):
        return fields.get(f"tokenizer.{key}", default)

    tokens = get("ggml.tokens")
    if not tokens:
        raise ModelLoadError(f"GGUF file {path!r} has no tokenizer.ggml.tokens")
    extra = {get(key) for key in ("ggml.eot_token_id", "ggml.eom_token_id")} - {None}
    return GGUFTokenizerMetadata(
        model=get("ggml.model", ""), pre=get("ggml.pre"), tokens=list(tokens),
        token_types=list(get("ggml.token_type", [1] * len(tokens))),
        merges=list(get("ggml.merges", [])),
        bos_token_id=get("ggml.bos_token_id"), eos_token_id=get("ggml.eos_token_id"),
        extra_eos_ids=frozenset(int(i) for i in extra),
        add_bos=bool(get("ggml.add_bos_token", False)), add_eos=bool(get("ggml.add_eos_token", False)),
        chat_template=get("chat_template"))


def _pre_tokenizer(pre: str | None):
    """The `tokenizers` pre-tokenizer for llama.cpp pre-tokenizer name `pre`."""
    name = pre or "gpt2"
    if name not in PRE_TOKENIZER_SPLITS:
        warnings.warn(f"unknown GGUF pre-tokenizer {name!r}; using the GPT-2 regex", stacklevel=3)
    steps = []
    for regex in PRE_TOKENIZER_SPLITS.get(name, (_GPT2,)):
        if regex is None:
            steps.append(pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True))
        else:
            steps.append(pre_tokenizers.Split(Regex(regex), behavior="isolated"))
    if not any(isinstance(step, pre_tokenizers.ByteLevel) for step in steps):
        steps.append(pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False))
    return pre_tokenizers.Sequence(steps)


def _split_merge(merge) -> tuple[str, str]:
    """A merge stored as ``"a b"`` or as a pair, as a pair."""
    if isinstance(merge, str):
        left, sep, right = merge.partition(" ")
        if not sep:
            raise ModelLoadError(f"malformed BPE merge {merge!r}")
        return left, right
    left, right = merge
    return left, right


def build_byte_level_bpe(meta: GGUFTokenizerMetadata) -> BackendTokenizer:
    """A byte-level BPE `tokenizers.Tokenizer` whose ids are the GGUF token ids.

    Normal tokens are spelled in the byte alphabet (respelled if a file stored raw
    text). Control tokens become special added tokens, user-defined tokens plain
    added tokens, both matched whole in the text and keyed by their own text so
    they keep their GGUF id; the ByteLevel decoder writes such tokens' raw UTF-8.
    """
    if meta.model != "gpt2":
        raise ModelLoadError(f"unsupported GGUF tokenizer model {meta.model!r} (only 'gpt2' byte-level BPE)")
    spelling = bytes_to_unicode()
    alphabet = set(spelling.values())
    vocab: dict[str, int] = {}
    special, user_defined = [], []
    for index, (token, token_type) in enumerate(zip(meta.tokens, meta.token_types)):
        if token_type == TOKEN_TYPE_CONTROL:
            special.append(token)
        elif token_type == TOKEN_TYPE_USER_DEFINED:
            user_defined.append(token)
        elif not set(token) <= alphabet:
            token = "".join(spelling[b] for b in token.encode("utf-8"))
        vocab.setdefault(token, index)
    merges = [_split_merge(m) for m in meta.merges]
    bpe = models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False,
                     ignore_merges=(meta.pre in IGNORE_MERGES_PRE))
    backend = BackendTokenizer(bpe)
    backend.pre_tokenizer = _pre_tokenizer(meta.pre)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in special])
    backend.add_tokens([AddedToken(t, special=False, normalized=False) for t in user_defined])
    if backend.get_vocab_size(with_added_tokens=True) != len(vocab):
        raise ModelLoadError("GGUF vocabulary has special tokens missing from its token list")
    return backend
