"""Quantised weights packed for a device, multiplied by PyTorch's own kernels.

- int8: ``torch.ops.aten._weight_int8pack_mm(x, codes [N, K], scales [N])`` (CPU and CUDA).
- int4: CPU ``_convert_weight_to_int4pack_for_cpu`` + ``_weight_int4pack_mm_for_cpu``;
  CUDA ``_convert_weight_to_int4pack`` + ``_weight_int4pack_mm`` (tinygemm layout);
  scales and zeros as one ``[K / group, N, 2]`` tensor.

Activations enter the kernels in bfloat16 and leave as the model's dtype. Measured on
an AVX2 EPYC, one thread (``benchmarks/quantization.py`` prints the table): the kernels'
float32-input path is a scalar reference ~10x slower than float32 GEMM, their bfloat16
path is vectorised (30 layers of the default model at one row: fp32 33.8 ms, int8 21.2,
int4 16.9). Rows are computed independently of the batch: results do not depend on
how many rows share the call.
"""
from __future__ import annotations

import torch

from kvserve.quant.formats import Int4Weight, Int8Weight

COMPUTE_DTYPE = torch.bfloat16
INT4_INNER_K_TILES = 8        # the int4 packing's K tiling (CPU and CUDA accept 2, 4, 8)
INT4_K_TILE = 16              # CUDA's tinygemm layout: K must be a multiple of inner_k_tiles x 16


def cuda_inner_k_tiles(in_features: int) -> int | None:
    """The largest inner K tiling (8, 4, 2) CUDA's int4 packing accepts for ``in_features``
    (it needs ``K % (tiles x 16) == 0``; SmolLM2's K = 576 takes 4); None when none does."""
    for tiles in (8, 4, 2):
        if in_features % (tiles * INT4_K_TILE) == 0:
            return tiles
    return None


class Int8Kernel:
    """``y = x @ W.T`` for an :class:`Int8Weight` on ``device``."""

    layout = "int8"

    def __init__(self, weight: Int8Weight, device: torch.device):
        self.codes = weight.codes.to(device).contiguous()
        self.scales = weight.scales.to(device=device, dtype=COMPUTE_DTYPE)
        self.out_features, self.in_features = weight.shape
        self._packed_op = True
        try:                       # a build without the op on this device: widen codes per call
            torch.ops.aten._weight_int8pack_mm(torch.zeros(1, self.in_features, dtype=COMPUTE_DTYPE,
                                                           device=device), self.codes, self.scales)
        except (RuntimeError, NotImplementedError):
            self._packed_op = False

    @property
    def nbytes(self) -> int:
        return self.codes.numel() + self.scales.numel() * self.scales.element_size()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, in] -> [T, out] in x's dtype."""
        xc = x.to(COMPUTE_DTYPE)
        if self._packed_op:
            return torch.ops.aten._weight_int8pack_mm(xc, self.codes, self.scales).to(x.dtype)
        return (xc @ self.codes.to(COMPUTE_DTYPE).t()).mul_(self.scales).to(x.dtype)


class Int4Kernel:
    """``y = x @ W.T`` for an :class:`Int4Weight` on ``device``."""

    layout = "int4"

    def __init__(self, weight: Int4Weight, device: torch.device):
        self.group_size = weight.group_size
        self.out_features, self.in_features = weight.shape
        codes = weight.codes.to(device)
        if device.type == "cuda":
            tiles = cuda_inner_k_tiles(self.in_features)
            if tiles is None:
                raise ValueError(f"int4 on CUDA needs in_features divisible by 32, got {self.in_features}")
            pairs = (codes[:, ::2] << 4 | codes[:, 1::2]).to(torch.uint8).contiguous()
            self.packed = torch.ops.aten._convert_weight_to_int4pack(pairs, tiles)
            self._mm = torch.ops.aten._weight_int4pack_mm
        else:
            self.packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(
                codes.to(torch.int32).contiguous(), INT4_INNER_K_TILES)
            self._mm = torch.ops.aten._weight_int4pack_mm_for_cpu
        self.scales_and_zeros = torch.stack([weight.scales.t(), weight.zeros.t()], dim=-1).to(
            device=device, dtype=COMPUTE_DTYPE).contiguous()

    @property
    def nbytes(self) -> int:
        sz = self.scales_and_zeros
        return self.packed.numel() * self.packed.element_size() + sz.numel() * sz.element_size()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, in] -> [T, out] in x's dtype."""
        y = self._mm(x.to(COMPUTE_DTYPE).contiguous(), self.packed, self.group_size, self.scales_and_zeros)
        return y.to(x.dtype)


def make_kernel(weight: Int4Weight | Int8Weight, device: torch.device):
    """The kernel object for ``weight``'s format on ``device``."""
    return Int4Kernel(weight, device) if isinstance(weight, Int4Weight) else Int8Kernel(weight, device)
