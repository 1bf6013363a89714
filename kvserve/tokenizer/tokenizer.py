"""The tokenizer the server uses: encode, decode and chat templates.

One class wraps a Rust `tokenizers.Tokenizer` built either from a GGUF file's
metadata (see gguf_vocab.py) or from a Hugging Face folder (tokenizer.json +
tokenizer_config.json). Everything the rest of kvserve needs to know about
special tokens (BOS/EOS, end-of-turn tokens, which ids to hide) is resolved once
here, from the checkpoint, never from its file name.
"""
from __future__ import annotations

import functools
import json
import os
from typing import Iterable

from tokenizers import Tokenizer as BackendTokenizer

from kvserve.errors import InvalidRequestError, ModelLoadError
from kvserve.tokenizer.chat_template import FALLBACK_TEMPLATE, ChatTemplateRenderer
from kvserve.tokenizer.fim import FimTokens, build_fim_prompt, detect_fim, require_fim
from kvserve.tokenizer.gguf_vocab import build_byte_level_bpe, read_gguf_tokenizer_metadata

# Tokens that close a chat turn in common templates (llama.cpp's list of EOT texts).
END_OF_TURN_TEXTS = frozenset({
    "<|im_end|>", "<|eot_id|>", "<|eom_id|>", "<|end|>", "<end_of_turn>", "<|end_of_turn|>",
    "<|END_OF_TURN_TOKEN|>", "<｜end▁of▁sentence｜>", "<|endoftext|>", "<EOT>", "<|return|>",
    "<end_of_utterance>",
})


class Tokenizer:
    """Text <-> token ids for one checkpoint, plus its chat template.

    Build it with `load`, `from_gguf` or `from_hf_folder`. Attributes:
    `vocab_size` (ids are in ``[0, vocab_size)``), `bos_token_id`, `eos_token_id`,
    `eos_token_ids` (EOS plus the template's end-of-turn control token and any
    extra EOS the checkpoint lists), `all_special_ids`, `chat_template`, and
    `fim_tokens` (the fill-in-the-middle layout of the vocabulary, or None).
    """

    def __init__(self, backend: BackendTokenizer, *, bos_token_id: int | None, eos_token_id: int | None,
                 add_bos: bool = False, add_eos: bool = False, chat_template: str | None = None,
                 extra_eos_ids: Iterable[int] = (), vocab_size: int | None = None):
        """Wrap `backend`; prefer the `from_*` constructors, which read these from a checkpoint."""
        self._backend = backend
        self.bos_token_id = bos_token_id
        self.eos_token_id = eos_token_id
        self.add_bos = bool(add_bos and bos_token_id is not None)
        self.add_eos = bool(add_eos and eos_token_id is not None)
        self.chat_template = chat_template or None
        self.vocab_size = vocab_size or backend.get_vocab_size(with_added_tokens=True)
        added = backend.get_added_tokens_decoder()
        special = {i for i, tok in added.items() if tok.special}
        special |= {i for i in (bos_token_id, eos_token_id) if i is not None}
        self.all_special_ids = frozenset(special)
        eos = {i for i in (eos_token_id, *extra_eos_ids) if i is not None}
        if self.chat_template:
            eos |= {i for i, tok in added.items()
                    if tok.special and tok.content in END_OF_TURN_TEXTS and tok.content in self.chat_template}
        self.eos_token_ids = frozenset(eos)
        self._renderer = ChatTemplateRenderer()

    # ----------------------------------------------------------------- loading
    @classmethod
    def load(cls, path: str) -> "Tokenizer":
        """Load from a ``.gguf`` file or a Hugging Face folder (raises ModelLoadError)."""
        if os.path.isdir(path):
            return cls.from_hf_folder(path)
        if os.path.isfile(path):
            with open(path, "rb") as f:
                magic = f.read(4)
            if magic == b"GGUF" or path.endswith(".gguf"):
                return cls.from_gguf(path)
            if os.path.basename(path) == "tokenizer.json":
                return cls.from_hf_folder(os.path.dirname(path) or ".")
        raise ModelLoadError(f"no tokenizer at {path!r}: expected a .gguf file or a folder with tokenizer.json")

    @classmethod
    def from_gguf(cls, path: str) -> "Tokenizer":
        """Build the tokenizer a GGUF file describes (byte-level BPE, ``tokenizer.ggml.model == "gpt2"``)."""
        meta = read_gguf_tokenizer_metadata(path)
        backend = build_byte_level_bpe(meta)
        return cls(backend, bos_token_id=meta.bos_token_id, eos_token_id=meta.eos_token_id,
                   add_bos=meta.add_bos, add_eos=meta.add_eos, chat_template=meta.chat_template,
                   extra_eos_ids=meta.extra_eos_ids, vocab_size=len(meta.tokens))

    @classmethod
    def from_hf_folder(cls, path: str) -> "Tokenizer":
        """Load tokenizer.json, tokenizer_config.json, chat_template.jinja and generation_config.json.

        BOS/EOS come from the config's ``bos_token``/``eos_token``; add_bos/add_eos
        from ``add_bos_token``/``add_eos_token`` when present, else from what the
        tokenizer.json post-processor adds. The chat template is chat_template.jinja
        if present, else the config's ``chat_template`` (a string, or a list of
        named templates of which "default" is used).
        """
        tokenizer_file = os.path.join(path, "tokenizer.json")
        if not os.path.isfile(tokenizer_file):
            raise ModelLoadError(f"no tokenizer.json in {path!r}")
        try:
            backend = BackendTokenizer.from_file(tokenizer_file)
        except Exception as exc:  # the Rust side raises plain Exception subclasses
            raise ModelLoadError(f"cannot parse {tokenizer_file!r}: {exc}") from exc
        config = _read_json(os.path.join(path, "tokenizer_config.json"))
        bos_id = _token_id(backend, config.get("bos_token"))
        eos_id = _token_id(backend, config.get("eos_token"))
        add_bos, add_eos = _post_processor_adds(backend, bos_id, eos_id)
        if config.get("add_bos_token") is not None:
            add_bos = bool(config["add_bos_token"])
        if config.get("add_eos_token") is not None:
            add_eos = bool(config["add_eos_token"])
        generation_eos = _read_json(os.path.join(path, "generation_config.json")).get("eos_token_id")
        if isinstance(generation_eos, int):
            generation_eos = [generation_eos]
        return cls(backend, bos_token_id=bos_id, eos_token_id=eos_id, add_bos=add_bos, add_eos=add_eos,
                   chat_template=_hf_chat_template(path, config), extra_eos_ids=generation_eos or ())

    # -------------------------------------------------------------- encode/decode
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`; special-token texts in it map to their ids.

        With `add_special_tokens`, BOS is prepended (EOS appended) only when the
        checkpoint says so (``add_bos_token``/``add_eos_token``).
        """
        if not isinstance(text, str):
            raise InvalidRequestError("text to tokenize must be a string", param="prompt")
        ids = self._backend.encode(text, add_special_tokens=False).ids
        if add_special_tokens:
            if self.add_bos:
                ids = [self.bos_token_id, *ids]
            if self.add_eos:
                ids = [*ids, self.eos_token_id]
        return ids

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        """Text of `ids`; special tokens are left out when `skip_special_tokens`.

        Bytes that do not form complete UTF-8 characters decode to U+FFFD.
        """
        return self._backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def convert_ids_to_tokens(self, ids: Iterable[int]) -> list[str]:
        """The vocabulary spelling of each id (None for ids outside the vocabulary)."""
        return [self._backend.id_to_token(int(i)) for i in ids]

    def token_to_id(self, token: str) -> int | None:
        """The id of vocabulary entry `token`, or None."""
        return self._backend.token_to_id(token)

    # ------------------------------------------------------------ fill in the middle
    @functools.cached_property
    def fim_tokens(self) -> FimTokens | None:
        """The FIM layout this vocabulary declares (see fim.py), detected once per instance; None if none."""
        return detect_fim(self, self.vocab_size)

    def encode_fim(self, prefix: str, suffix: str) -> list[int]:
        """The FIM prompt for `prefix` and `suffix` (fim.build_fim_prompt); without `fim_tokens`,
        InvalidRequestError(param="suffix")."""
        return build_fim_prompt(self, require_fim(self.fim_tokens), prefix, suffix)

    # ------------------------------------------------------------ chat template
    @property
    def bos_token(self) -> str | None:
        """The BOS token's text, as chat templates see it."""
        return None if self.bos_token_id is None else self._backend.id_to_token(self.bos_token_id)

    @property
    def eos_token(self) -> str | None:
        """The EOS token's text, as chat templates see it."""
        return None if self.eos_token_id is None else self._backend.id_to_token(self.eos_token_id)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True, **kwargs) -> str:
        """Render `messages` with the checkpoint's chat template, as HF does (``tokenize=False``).

        Extra keywords (``tools``, ``documents``, ``enable_thinking``...) reach the
        template as variables; ``chat_template=...`` replaces the template for this
        call. Without a template, FALLBACK_TEMPLATE (``"role: content"`` lines) is
        used. Bad messages raise InvalidRequestError(param="messages").
        """
        override = kwargs.pop("chat_template", None)
        if override is not None and not isinstance(override, str):
            raise InvalidRequestError("chat_template must be a string", param="chat_template")
        template = override or self.chat_template or FALLBACK_TEMPLATE
        variables = {"bos_token": self.bos_token or "", "eos_token": self.eos_token or "", **kwargs}
        return self._renderer.render(template, messages, add_generation_prompt=bool(add_generation_prompt),
                                     from_request=override is not None, variables=variables)

    def __repr__(self) -> str:
        return (f"Tokenizer(vocab_size={self.vocab_size}, bos={self.bos_token_id}, eos={self.eos_token_id}, "
                f"eos_ids={sorted(self.eos_token_ids)}, add_bos={self.add_bos})")


def _read_json(path: str) -> dict:
    if not os.path.isfile(path):
        return {}
    try:
        with open(path, encoding="utf-8") as f:
            value = json.load(f)
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"cannot parse {path!r}: {exc}") from exc
    return value if isinstance(value, dict) else {}


def _token_id(backend: BackendTokenizer, token) -> int | None:
    """Id of a config token given as a string or as ``{"content": ...}``."""
    if isinstance(token, dict):
        token = token.get("content")
    return backend.token_to_id(token) if isinstance(token, str) else None


def _post_processor_adds(backend: BackendTokenizer, bos_id: int | None, eos_id: int | None) -> tuple[bool, bool]:
    """Whether tokenizer.json's post-processor adds BOS / EOS to a single sequence."""
    plain = backend.encode("a", add_special_tokens=False).ids
    full = backend.encode("a", add_special_tokens=True).ids
    added_bos = bos_id is not None and len(full) > len(plain) and full[0] == bos_id != plain[0]
    added_eos = eos_id is not None and len(full) > len(plain) and full[-1] == eos_id != plain[-1]
    return added_bos, added_eos


def _hf_chat_template(path: str, config: dict) -> str | None:
    jinja_file = os.path.join(path, "chat_template.jinja")
    if os.path.isfile(jinja_file):
        with open(jinja_file, encoding="utf-8") as f:
            return f.read()
    template = config.get("chat_template")
    if isinstance(template, list):  # [{"name": ..., "template": ...}, ...]
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default") or next(iter(named.values()), None)
    return template if isinstance(template, str) else None
