"""GGUF's 4- and 8-bit blocks dequantised to float32 a whole tensor at a time.

The ``gguf`` package dequantises row group by row group, splitting arrays along the way; for
the default model (210 Q4_1 tensors) that was 1.3 s of the 2 s start-up read, the cold start's
second layer. Here a tensor's blocks are one structured array (``quant.gguf_blocks``' block
layouts) and each formula a few in-place operations on the whole tensor, the same float32
operations as ``gguf``'s (``Q4_0``: ``d * (q - 8)``; ``Q4_1``: ``d * q + m``; ``Q8_0``:
``q * d``; in a 4-bit block byte ``j`` holds weight ``j`` in its low nibble and ``j + 16`` in
its high one), so the values are bit-identical (``tests/unit/test_gguf_dequant.py`` checks it against ``gguf``). Other types
return None: the loader falls back to ``gguf``.
"""
from __future__ import annotations

import numpy as np

from kvserve.quant.gguf_blocks import BLOCK, block_dtype

BLOCK_TYPES = ("Q4_0", "Q4_1", "Q8_0")


def dequantize_blocks(raw: np.ndarray, type_name: str, shape: tuple[int, ...]) -> np.ndarray | None:
    """``raw`` (a tensor's bytes) stored as ``type_name`` as a C-contiguous float32 array of
    ``shape``; None for a type this module does not read."""
    if type_name not in BLOCK_TYPES:
        return None
    count = int(np.prod(shape))
    if count % BLOCK:
        raise ValueError(f"{type_name} tensor of {count} weights is not whole blocks of {BLOCK}")
    blocks = np.frombuffer(raw, dtype=block_dtype(type_name), count=count // BLOCK)
    d = blocks["d"].astype(np.float32)[:, None]
    out = np.empty((len(blocks), BLOCK), dtype=np.float32)
    if type_name == "Q8_0":
        out[:] = blocks["qs"]
        out *= d
        return out.reshape(shape)
    nibbles = blocks["qs"]
    half = BLOCK // 2
    if type_name == "Q4_0":
        out[:, :half] = (nibbles & np.uint8(0x0F)).view(np.int8) - np.int8(8)
        out[:, half:] = (nibbles >> np.uint8(4)).view(np.int8) - np.int8(8)
        out *= d
        return out.reshape(shape)
    out[:, :half] = nibbles & np.uint8(0x0F)
    out[:, half:] = nibbles >> np.uint8(4)
    out *= d
    out += blocks["m"].astype(np.float32)[:, None]
    return out.reshape(shape)
