"""llama.cpp's 4- and 8-bit blocks read straight into :mod:`kvserve.quant.formats`,
without a float32 copy of the matrix.

A row of ``in`` weights is ``in / 32`` consecutive blocks of 32 (ggml's ``QK4_0`` /
``QK4_1`` / ``QK8_0``); in each 4-bit block byte ``j`` holds weight ``j`` in its low
nibble and weight ``j + 16`` in its high nibble:

- Q4_0: ``d`` (fp16), 16 bytes of nibbles; ``w = d * (q - 8)``      -> int4, zero 0
- Q4_1: ``d``, ``m`` (fp16), 16 bytes;     ``w = d * q + m``        -> int4, zero m + 8d
- Q8_0: ``d`` (fp16), 32 int8;             ``w = d * q``            -> int8, rescaled

Q8_0's scale is per block, the int8 kernel's per row: codes are rescaled to the row's
largest block scale (``round(q * d / d_max)``): exact in the blocks at ``d_max``, within
``d_max / 2`` elsewhere (the same bound as quantising the row from float).
"""
from __future__ import annotations

import numpy as np
import torch

from kvserve.quant.formats import Int4Weight, Int8Weight

BLOCK = 32
DIRECT_TYPES = {"int4": ("Q4_0", "Q4_1"), "int8": ("Q8_0",)}   # GGUF types read without float32
_BLOCK_DTYPES = {
    "Q4_0": np.dtype([("d", "<f2"), ("qs", "u1", 16)]),
    "Q4_1": np.dtype([("d", "<f2"), ("m", "<f2"), ("qs", "u1", 16)]),
    "Q8_0": np.dtype([("d", "<f2"), ("qs", "i1", 32)]),
}


def block_dtype(type_name: str) -> np.dtype:
    """The numpy record of one ``type_name`` block (``d``, ``m`` where the type has it, ``qs``)."""
    return _BLOCK_DTYPES[type_name]


def read_blocks(raw: np.ndarray, type_name: str, shape: tuple[int, int]) -> Int4Weight | Int8Weight:
    """The ``[out, in]`` weight of ``raw`` (the tensor's bytes) stored as ``type_name``."""
    rows, cols = shape
    if cols % BLOCK:
        raise ValueError(f"{type_name} rows of {cols} weights are not whole blocks of {BLOCK}")
    blocks = np.frombuffer(raw, dtype=_BLOCK_DTYPES[type_name], count=rows * cols // BLOCK)
    blocks = blocks.reshape(rows, cols // BLOCK)
    d = torch.from_numpy(blocks["d"].astype(np.float32))
    if type_name == "Q8_0":
        return _q8_0(torch.from_numpy(blocks["qs"].astype(np.int16)), d, rows, cols)
    nibbles = torch.from_numpy(blocks["qs"].copy())                            # [N, B, 16]
    codes = torch.cat([nibbles & 0x0F, nibbles >> 4], dim=-1).reshape(rows, cols)
    zeros = torch.zeros_like(d) if type_name == "Q4_0" else torch.from_numpy(blocks["m"].astype(np.float32)) + 8 * d
    return Int4Weight(codes, d, zeros, BLOCK)


def _q8_0(codes: torch.Tensor, d: torch.Tensor, rows: int, cols: int) -> Int8Weight:
    """Per-block int8 -> per-row int8 (see the module docstring)."""
    d_max = d.abs().amax(1)
    d_max = torch.where(d_max > 0, d_max, torch.ones_like(d_max))
    ratio = (d / d_max[:, None])[..., None]                                     # [N, B, 1]
    rescaled = torch.round(codes.float() * ratio).clamp_(-127, 127).to(torch.int8)
    return Int8Weight(rescaled.reshape(rows, cols), d_max)
