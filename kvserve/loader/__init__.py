"""Checkpoint loaders: GGUF files and Hugging Face folders -> one :class:`Checkpoint`.

Tensors always come out under Hugging Face Llama names, float32, HF layout. Names load
lazily: the tokenizer reads GGUF metadata through ``gguf_file`` without importing torch.
"""
from __future__ import annotations

_NAMES = {"default_model_path": "api", "load_checkpoint": "api", "resolve_model_path": "api",
          "Checkpoint": "checkpoint"}

__all__ = sorted(_NAMES)


def __getattr__(name: str):
    if name in _NAMES:
        import importlib
        return getattr(importlib.import_module(f"kvserve.loader.{_NAMES[name]}"), name)
    raise AttributeError(name)
