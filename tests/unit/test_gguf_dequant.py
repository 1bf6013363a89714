"""The whole-tensor GGUF dequantiser (``loader/gguf_dequant.py``) against the ``gguf`` package's,
bit for bit, on random blocks of each type it reads."""
from __future__ import annotations

import numpy as np
import pytest
from gguf import GGMLQuantizationType, quants

from kvserve.loader.gguf_dequant import BLOCK_TYPES, dequantize_blocks
from kvserve.quant.gguf_blocks import block_dtype


def _random_blocks(type_name: str, count: int, rng: np.random.Generator) -> np.ndarray:
    blocks = np.zeros(count, dtype=block_dtype(type_name))
    blocks["d"] = rng.normal(0, 0.02, count).astype(np.float16)
    if "m" in blocks.dtype.names:
        blocks["m"] = rng.normal(0, 0.1, count).astype(np.float16)
    blocks["qs"] = rng.integers(0, 256, blocks["qs"].shape).astype(blocks["qs"].dtype)
    return blocks.view(np.uint8)


@pytest.mark.parametrize("type_name", BLOCK_TYPES)
def test_bit_identical_to_gguf(type_name):
    rng = np.random.default_rng(len(type_name))
    shape = (24, 96)                                    # rows of three blocks
    raw = _random_blocks(type_name, 24 * 3, rng)
    ours = dequantize_blocks(raw, type_name, shape)
    theirs = quants.dequantize(raw, GGMLQuantizationType[type_name]).astype(np.float32).reshape(shape)
    assert ours.dtype == np.float32 and ours.flags.c_contiguous and ours.flags.writeable
    assert np.array_equal(ours.view(np.uint32), theirs.view(np.uint32))


def test_other_types_fall_back_and_partial_blocks_are_refused():
    assert dequantize_blocks(np.zeros(8, np.uint8), "F16", (4,)) is None
    assert dequantize_blocks(np.zeros(8, np.uint8), "Q6_K", (4,)) is None
    with pytest.raises(ValueError, match="whole blocks"):
        dequantize_blocks(np.zeros(40, np.uint8), "Q4_1", (2, 20))
