"""8-bit KV cache: codes plus one fp32 scale per (token, kv head), dequantised on read.

Formats (``KV_FORMATS``), all symmetric, ``scale = amax over head_dim / format max``:

- ``int8``: codes ``round(x / scale)`` in [-127, 127] (error <= scale / 2 per element);
- ``fp8_e4m3`` / ``fp8_e5m2``: ``x / scale`` cast to ``float8_e4m3fn`` (max 448) or
  ``float8_e5m2`` (max 57344), round to nearest even; stored as their bytes (``uint8``,
  since CPU ``index_copy_`` has no float8 kernel) and bitcast back with ``.view``.

:class:`QuantizedKV` holds ``codes [..., D]`` and ``scales [...]`` with the same leading
dims, so the indexing the engine does on a plain cache tensor works unchanged:
``cache[i, 0]`` is one layer's K plane ``[blocks, block_size, KVH, D]``, ``cache[:n]`` the
first layers, ``cache[:, :, dst] = cache[:, :, src]`` a block copy (copy-on-write). Its
``dtype`` is the compute dtype reads dequantise to; ``format`` names the storage.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class KVFormat:
    """One 8-bit KV storage format."""

    name: str
    code_dtype: torch.dtype       # the dtype the codes mean (int8, float8_*)
    storage_dtype: torch.dtype    # the dtype the cache tensor holds (int8; uint8 bytes for float8)
    max_code: float               # largest finite magnitude of a code (127, 448, 57344)

    def quantize(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [..., D] float -> (codes [..., D] in ``storage_dtype``, fp32 scales [...]).

        An all-zero row gets scale 0 and codes 0 (dequantises to exact zeros)."""
        xf = x.float()
        scales = xf.abs().amax(dim=-1) / self.max_code
        scaled = xf / torch.where(scales > 0, scales, 1.0).unsqueeze(-1)
        if self.code_dtype == torch.int8:
            codes = scaled.round_().clamp_(-self.max_code, self.max_code).to(torch.int8)
        else:
            codes = scaled.clamp_(-self.max_code, self.max_code).to(self.code_dtype).view(self.storage_dtype)
        return codes, scales

    def dequantize(self, codes: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype,
                   out: torch.Tensor | None = None) -> torch.Tensor:
        """codes [..., D] (storage dtype), scales [...] -> values [..., D] in ``dtype``
        (into ``out`` when given: no allocation)."""
        if out is None:
            out = torch.empty(codes.shape, dtype=dtype, device=codes.device)
        if self.code_dtype != torch.int8 and codes.device.type == "cpu":
            # CPU float8 -> float casts are slow (~50x int8's): look the 256 byte values up instead (exact)
            table = FP8_TABLES[self.name].to(dtype)
            torch.index_select(table, 0, codes.reshape(-1).int(), out=out.view(-1))
        else:
            out.copy_(codes.view(self.code_dtype))
        return out.mul_(scales.unsqueeze(-1).to(dtype))


# Every float8 byte's value (float32), per format: the CPU dequantisation table (read-only use).
FP8_TABLES = {name: torch.arange(256, dtype=torch.uint8).view(dt).float()
              for name, dt in (("fp8_e4m3", torch.float8_e4m3fn), ("fp8_e5m2", torch.float8_e5m2))}

KV_FORMATS = {
    "int8": KVFormat("int8", torch.int8, torch.int8, 127.0),
    "fp8_e4m3": KVFormat("fp8_e4m3", torch.float8_e4m3fn, torch.uint8, 448.0),
    "fp8_e5m2": KVFormat("fp8_e5m2", torch.float8_e5m2, torch.uint8, 57344.0),
}


class QuantizedKV:
    """An 8-bit KV cache (or a view of part of it): ``codes [..., D]``, ``scales [...]``.

    Indexing keys address the leading dims only (never head_dim) and apply to codes and
    scales alike; results share storage with this cache, as tensor views do. A 4-dim
    ``[blocks, block_size, KVH, D]`` plane is what the attention backend reads and writes.
    """

    def __init__(self, codes: torch.Tensor, scales: torch.Tensor, fmt: KVFormat, dtype: torch.dtype):
        if codes.shape[:-1] != scales.shape:
            raise ValueError(f"codes {tuple(codes.shape)} and scales {tuple(scales.shape)} disagree")
        self.codes = codes
        self.scales = scales
        self.format = fmt
        self.dtype = dtype        # the compute dtype reads dequantise to

    @property
    def shape(self) -> torch.Size:
        return self.codes.shape

    @property
    def device(self) -> torch.device:
        return self.codes.device

    def dim(self) -> int:
        return self.codes.dim()

    @property
    def nbytes(self) -> int:
        """Bytes held: codes and scales."""
        return self.codes.numel() * self.codes.element_size() + self.scales.numel() * self.scales.element_size()

    def __getitem__(self, key) -> "QuantizedKV":
        return QuantizedKV(self.codes[key], self.scales[key], self.format, self.dtype)

    def __setitem__(self, key, value: "QuantizedKV") -> None:
        if not isinstance(value, QuantizedKV) or value.format != self.format:
            raise TypeError("a QuantizedKV takes only values of its own format")
        self.codes[key] = value.codes
        self.scales[key] = value.scales

    # ------------------------------------------------------------- plane ops
    def write(self, slots: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """Plane only: quantise x [T, KVH, D] into cache slots ``slots`` [T]; returns the
        values as stored (dequantised, in ``x.dtype``), so callers that attend the fresh
        tokens directly see exactly what later reads of the cache will."""
        num_kv_heads, head_dim = self.codes.shape[-2:]
        codes, scales = self.format.quantize(x)
        self.codes.view(-1, num_kv_heads, head_dim).index_copy_(0, slots, codes)
        self.scales.view(-1, num_kv_heads).index_copy_(0, slots, scales)
        return self.format.dequantize(codes, scales, x.dtype)

    def gather(self, block_ids: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """Plane only: blocks ``block_ids`` dequantised into ``out``
        ``[len(block_ids), block_size * KVH * D]`` (the caller's workspace)."""
        num_blocks = self.codes.shape[0]
        codes = torch.index_select(self.codes.view(num_blocks, -1), 0, block_ids)
        scales = torch.index_select(self.scales.view(num_blocks, -1), 0, block_ids)
        head_dim = self.codes.shape[-1]
        self.format.dequantize(codes.view(-1, head_dim), scales.view(-1), out.dtype, out=out.view(-1, head_dim))
        return out


def allocate_quantized_kv(shape: tuple[int, ...], fmt_name: str, dtype: torch.dtype,
                          device: torch.device) -> QuantizedKV:
    """A zeroed cache of ``shape`` ``[..., D]`` in format ``fmt_name`` (zeros: padded reads
    stay finite), dequantising to ``dtype``."""
    fmt = KV_FORMATS[fmt_name]
    return QuantizedKV(torch.zeros(shape, dtype=fmt.storage_dtype, device=device),
                       torch.zeros(shape[:-1], dtype=torch.float32, device=device), fmt, dtype)
