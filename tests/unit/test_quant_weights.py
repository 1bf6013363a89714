"""Tier 1: weight-only quantisation (kvserve.quant): formats, llama.cpp blocks and the
kernels, each against a float64 reference; a quantised Projection; batch invariance."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from kvserve.models.projection import Projection
from kvserve.quant.formats import Int4Weight, Int8Weight, as_format, quantize_int4, quantize_int8
from kvserve.quant.gguf_blocks import read_blocks
from kvserve.quant.kernels import COMPUTE_DTYPE, make_kernel

SHAPES = [(96, 64), (192, 128)]


def _weight(rows: int, cols: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(rows, cols, generator=g) * 0.05
    w[3, 5] = 0.9                                   # an outlier, as real checkpoints have
    w[7] = 0.0                                      # a constant row: its scale must not be 0
    return w


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("group", [32, 64])
def test_int4_round_trip_within_half_a_step(shape, group):
    w = _weight(*shape)
    q = quantize_int4(w, group)
    assert q.codes.dtype == torch.uint8 and int(q.codes.max()) <= 15
    err = (q.dequantize() - w.double()).abs().view(shape[0], -1, group)
    assert bool((err <= q.scales.double()[..., None] / 2 + 1e-6).all())


@pytest.mark.parametrize("shape", SHAPES)
def test_int8_round_trip_within_half_a_step(shape):
    w = _weight(*shape)
    q = quantize_int8(w)
    assert q.codes.dtype == torch.int8 and int(q.codes.abs().max()) <= 127
    assert q.scales.equal(q.scales.bfloat16().float())          # the kernel's exact scale
    err = (q.dequantize() - w.double()).abs()
    assert bool((err <= q.scales.double()[:, None] / 2 + 1e-6).all())
    assert float(err[7].max()) == 0.0


@pytest.mark.parametrize("type_name", ["Q4_0", "Q4_1", "Q8_0"])
def test_gguf_blocks_read_without_float32(type_name):
    from gguf import GGMLQuantizationType, quants
    w = _weight(16, 128).numpy()
    qtype = GGMLQuantizationType[type_name]
    raw = quants.quantize(w, qtype)
    expected = torch.from_numpy(quants.dequantize(raw, qtype).reshape(w.shape)).double()
    got = read_blocks(raw.reshape(-1), type_name, w.shape)
    if type_name == "Q8_0":                          # rescaled to one scale per row
        assert isinstance(got, Int8Weight)
        assert float((got.dequantize() - expected).abs().max()) <= float(got.scales.max()) / 2 + 1e-6
    else:
        assert isinstance(got, Int4Weight) and got.group_size == 32
        assert torch.allclose(got.dequantize(), expected, rtol=0, atol=1e-6)


def test_rows_and_cat_are_row_operations():
    parts = [quantize_int4(_weight(32, 64, s)) for s in range(3)]
    fused = Int4Weight.cat(parts)
    assert fused.dequantize().equal(torch.cat([p.dequantize() for p in parts]))
    perm = torch.randperm(96)
    assert fused.rows(perm).dequantize().equal(fused.dequantize()[perm])
    mixed = Int8Weight.cat([quantize_int8(_weight(32, 64)), _weight(16, 64, 1)])
    assert mixed.shape == (48, 64)
    assert as_format(fused, "int4") is fused and isinstance(as_format(fused, "int8"), Int8Weight)


def _kernel_bound(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """bf16 output rounding (2^-9 relative) plus bf16 weight dequantisation and fp32
    accumulation, each at most 2^-8 of sum |x| |w|: a 2^-7 bound on |y - y_ref|."""
    return (x.abs() @ w.abs().t()) * 2.0 ** -7 + 1e-6


@pytest.mark.parametrize("scheme", ["int8", "int4"])
def test_kernel_matches_float64_reference(scheme):
    w = _weight(192, 128)
    q = as_format(w, scheme)
    kernel = make_kernel(q, torch.device("cpu"))
    x = torch.randn(9, 128, generator=torch.Generator().manual_seed(1))
    x_in = x.to(COMPUTE_DTYPE).double()                   # what the kernel sees
    deq = q.dequantize()
    if scheme == "int4":                                  # scales and zeros enter in bf16
        deq = Int4Weight(q.codes, q.scales.bfloat16().float(), q.zeros.bfloat16().float(),
                         q.group_size).dequantize()
    ref = x_in @ deq.t()
    got = kernel(x).double()
    assert kernel(x).dtype == torch.float32
    assert bool(((got - ref).abs() <= _kernel_bound(x_in, deq)).all())


@pytest.mark.parametrize("scheme", ["int8", "int4"])
def test_kernel_rows_do_not_depend_on_the_batch(scheme):
    kernel = make_kernel(as_format(_weight(192, 128), scheme), torch.device("cpu"))
    x = torch.randn(37, 128, generator=torch.Generator().manual_seed(2))
    full = kernel(x)
    for start, rows in [(0, 1), (5, 3), (20, 16), (3, 8)]:
        assert kernel(x[start:start + rows]).equal(full[start:start + rows])


@pytest.mark.parametrize("scheme", ["int8", "int4"])
def test_projection_with_a_kernel(scheme):
    proj = Projection(192, 128, bias=True)
    proj.weight.data.copy_(_weight(192, 128))
    proj.bias.data.copy_(torch.linspace(-1, 1, 192))
    kernel = make_kernel(as_format(proj.weight.data, scheme), torch.device("cpu"))
    proj.use_kernel(kernel)
    assert proj.weight is None and proj.layout == scheme and proj.packed_bytes == kernel.nbytes
    x = torch.randn(4, 128)
    assert proj(x).equal(kernel(x) + proj.bias)
    out = torch.ones(4, 192)
    assert proj.accumulate_(out, x).equal(torch.ones(4, 192) + (kernel(x) + proj.bias))
    assert proj.pack() == scheme                              # packing leaves a kernel alone


def test_cuda_int4_tiling_fits_the_in_features():
    """CUDA's tinygemm packing needs K % (tiles x 16) == 0: SmolLM2's K = 576 takes 4 tiles (8
    failed on an H200), 1536 takes 8, a K no group size divides takes none."""
    from kvserve.quant.kernels import cuda_inner_k_tiles
    assert [cuda_inner_k_tiles(k) for k in (576, 1536, 4096, 96, 80)] == [4, 8, 8, 2, None]
