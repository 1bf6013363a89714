"""Quantised weights before they meet a kernel: codes and scales in Hugging Face's
``[out, in]`` row order, so that the loader's row operations (fusing q/k/v and gate/up
by concatenating rows, undoing llama.cpp's rotary row permutation) apply to them as to
float tensors: both formats scale along the input axis only, so rows are independent.

- int4, grouped and asymmetric: ``w[n, k] = scale[n, j] * (code[n, k] - 8) + zero[n, j]``,
  ``j = k // group_size``, codes 0..15. This is the form PyTorch's int4 kernels take;
  llama.cpp's Q4_1 (``d * q + m``) is ``scale = d, zero = m + 8 d`` and Q4_0
  (``d * (q - 8)``) is ``scale = d, zero = 0``: the same numbers, no re-rounding.
- int8, per output channel, symmetric: ``w[n, k] = scale[n] * code[n, k]``, codes -127..127.

Rounding to the nearest code bounds the error of a weight quantised from float by half a
step: ``scale / 2`` (int4: ``(max - min) / 30`` of its group; int8: ``amax / 254`` of its row).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

INT4_GROUP_SIZES = (32, 64, 128, 256)       # what the int4 kernels accept
DEFAULT_INT4_GROUP = 32                     # llama.cpp's Q4 block: the best-measured quality


@dataclass
class Int4Weight:
    """Grouped 4-bit weight ``[out, in]`` (see the module docstring)."""

    codes: torch.Tensor       # uint8 [N, K], values 0..15
    scales: torch.Tensor      # float32 [N, K // group_size]
    zeros: torch.Tensor       # float32 [N, K // group_size]
    group_size: int

    @property
    def shape(self) -> torch.Size:
        return self.codes.shape

    def rows(self, index: torch.Tensor) -> "Int4Weight":
        """The rows ``index`` (a permutation or a selection), same groups."""
        return Int4Weight(self.codes[index], self.scales[index], self.zeros[index], self.group_size)

    def cols(self, lo: int, hi: int) -> "Int4Weight":
        """Input features ``[lo, hi)`` (a row-parallel shard); both ends on group boundaries."""
        g = self.group_size
        if lo % g or hi % g:
            raise ValueError(f"int4 groups of {g} inputs cannot be split at [{lo}, {hi})")
        return Int4Weight(self.codes[:, lo:hi].contiguous(), self.scales[:, lo // g:hi // g].contiguous(),
                          self.zeros[:, lo // g:hi // g].contiguous(), g)

    def dequantize(self, dtype: torch.dtype = torch.float64) -> torch.Tensor:
        """``[N, K]`` in ``dtype`` (float64: the reference the kernels are checked against)."""
        rows, cols = self.codes.shape
        codes = self.codes.to(dtype).view(rows, cols // self.group_size, self.group_size)
        w = (codes - 8) * self.scales.to(dtype)[..., None] + self.zeros.to(dtype)[..., None]
        return w.view(rows, cols)

    @staticmethod
    def cat(parts: list) -> "Int4Weight":
        """Concatenate rows; float parts are quantised to the first int4 part's groups."""
        group = next(p.group_size for p in parts if isinstance(p, Int4Weight))
        parts = [p if isinstance(p, Int4Weight) else quantize_int4(p, group) for p in parts]
        if any(p.group_size != group for p in parts):
            parts = [p if p.group_size == group else quantize_int4(p.dequantize(torch.float32), group)
                     for p in parts]
        return Int4Weight(torch.cat([p.codes for p in parts]), torch.cat([p.scales for p in parts]),
                          torch.cat([p.zeros for p in parts]), group)


@dataclass
class Int8Weight:
    """Per-output-channel symmetric 8-bit weight ``[out, in]``."""

    codes: torch.Tensor       # int8 [N, K], values -127..127
    scales: torch.Tensor      # float32 [N]

    @property
    def shape(self) -> torch.Size:
        return self.codes.shape

    def rows(self, index: torch.Tensor) -> "Int8Weight":
        return Int8Weight(self.codes[index], self.scales[index])

    def cols(self, lo: int, hi: int) -> "Int8Weight":
        """Input features ``[lo, hi)`` (a row-parallel shard), with the whole rows' scales."""
        return Int8Weight(self.codes[:, lo:hi].contiguous(), self.scales)

    def dequantize(self, dtype: torch.dtype = torch.float64) -> torch.Tensor:
        return self.codes.to(dtype) * self.scales.to(dtype)[:, None]

    @staticmethod
    def cat(parts: list) -> "Int8Weight":
        """Concatenate rows; float parts are quantised per channel."""
        parts = [p if isinstance(p, Int8Weight) else quantize_int8(p) for p in parts]
        return Int8Weight(torch.cat([p.codes for p in parts]), torch.cat([p.scales for p in parts]))


QuantizedWeight = Int4Weight | Int8Weight


def quantize_int4(weight: torch.Tensor, group_size: int = DEFAULT_INT4_GROUP) -> Int4Weight:
    """Asymmetric min/max quantisation of each group of ``group_size`` inputs of each row."""
    rows, cols = weight.shape
    if group_size not in INT4_GROUP_SIZES or cols % group_size:
        raise ValueError(f"int4 group size {group_size} must be one of {INT4_GROUP_SIZES} and divide "
                         f"in_features {cols}")
    w = weight.detach().float().view(rows, cols // group_size, group_size)
    low, high = w.amin(-1), w.amax(-1)
    scales = (high - low) / 15
    scales = torch.where(scales > 0, scales, torch.ones_like(scales))
    codes = torch.round((w - low[..., None]) / scales[..., None]).clamp_(0, 15).to(torch.uint8)
    return Int4Weight(codes.view(rows, cols), scales, low + 8 * scales, group_size)


def quantize_int8(weight: torch.Tensor, scale_dtype: torch.dtype = torch.bfloat16) -> Int8Weight:
    """Symmetric quantisation of each row by its largest magnitude. The scale is
    rounded to ``scale_dtype`` (the kernels' bfloat16) before the codes are chosen, so
    the kernel multiplies by exactly the scale the codes were rounded against."""
    w = weight.detach().float()
    scales = w.abs().amax(1) / 127
    scales = torch.where(scales > 0, scales, torch.ones_like(scales)).to(scale_dtype).float()
    codes = torch.round(w / scales[:, None]).clamp_(-127, 127).to(torch.int8)
    return Int8Weight(codes, scales)


def as_format(source, scheme: str) -> QuantizedWeight:
    """``source`` (a float tensor or a quantised weight) in ``scheme`` ("int8" / "int4"):
    as it is when it already has that form, else quantised (from its float values)."""
    if scheme == "int4":
        return source if isinstance(source, Int4Weight) else quantize_int4(_float(source))
    if scheme == "int8":
        return source if isinstance(source, Int8Weight) else quantize_int8(_float(source))
    raise ValueError(f"unknown weight quantisation {scheme!r}")


def _float(source) -> torch.Tensor:
    return source.dequantize(torch.float32) if isinstance(source, (Int4Weight, Int8Weight)) else source
