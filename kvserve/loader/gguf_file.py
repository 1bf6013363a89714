"""A small, fast GGUF (v2/v3, little-endian) reader: metadata and the tensor index.

``gguf.GGUFReader`` decodes every metadata array element into numpy views, which takes
seconds for a 49k-token vocabulary; this reader walks the header with ``struct`` and
maps tensor data lazily. Dequantisation stays with ``gguf.quants``.
"""
from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass

import numpy as np

from kvserve.errors import ModelLoadError

# GGUF value type -> struct format of a scalar (8 = string, 9 = array).
_SCALAR_FORMATS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_STRING, _ARRAY = 8, 9
DEFAULT_ALIGNMENT = 32


@dataclass(frozen=True)
class GGUFTensorInfo:
    """One entry of the tensor index; ``shape`` in ggml order (fastest dimension first)."""

    name: str
    shape: tuple[int, ...]
    type_id: int
    offset: int          # absolute byte offset of the data in the file


@dataclass
class GGUFFile:
    """Metadata (arrays not kept are replaced by ``<key>.length``) and the tensor index."""

    path: str
    metadata: dict
    tensors: list[GGUFTensorInfo]
    file_size: int


def read_gguf_metadata(path: str, prefix: str = "") -> dict:
    """The key/value metadata whose keys start with ``prefix`` (all arrays decoded)."""
    return read_gguf(path, keep_arrays=lambda key: key.startswith(prefix), prefix=prefix).metadata


def read_gguf(path: str, keep_arrays=lambda key: not key.startswith("tokenizer."), prefix: str = "") -> GGUFFile:
    """Parse the header of the GGUF at ``path``. Arrays whose key fails ``keep_arrays``
    are skipped (only ``<key>.length`` is recorded). Raises ModelLoadError if corrupt."""
    try:
        with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
            return _parse(path, buf, keep_arrays, prefix)
    except ModelLoadError:
        raise
    except (OSError, ValueError, struct.error, UnicodeDecodeError, OverflowError, MemoryError) as exc:
        raise ModelLoadError(f"cannot read GGUF file {path} (truncated or corrupt?): {exc}",
                             param="model") from exc


def _parse(path: str, buf, keep_arrays, prefix: str) -> GGUFFile:
    if buf[:4] != b"GGUF":
        raise ModelLoadError(f"{path} is not a GGUF file (bad magic)", param="model")
    version, num_tensors, num_kv = struct.unpack_from("<IQQ", buf, 4)
    if version < 2 or version > 3:
        raise ModelLoadError(f"GGUF version {version} of {path} is not supported", param="model")
    if num_tensors > 1_000_000 or num_kv > 1_000_000:
        raise ModelLoadError(f"{path}: implausible GGUF header (corrupt?)", param="model")
    offset, metadata = 24, {}
    for _ in range(num_kv):
        key, offset = _read_string(buf, offset)
        (value_type,) = struct.unpack_from("<I", buf, offset)
        wanted = key.startswith(prefix)
        if value_type == _ARRAY:
            (count,) = struct.unpack_from("<Q", buf, offset + 8)
            keep = wanted and keep_arrays(key)
            value, offset = _read_value(buf, offset + 4, value_type, keep)
            if wanted:
                metadata[key + ".length"] = count
                if keep:
                    metadata[key] = value
        else:
            value, offset = _read_value(buf, offset + 4, value_type, True)
            if wanted:
                metadata[key] = value
    infos = []
    for _ in range(num_tensors):
        name, offset = _read_string(buf, offset)
        (n_dims,) = struct.unpack_from("<I", buf, offset)
        dims = struct.unpack_from("<" + "Q" * n_dims, buf, offset + 4)
        type_id, rel = struct.unpack_from("<IQ", buf, offset + 4 + 8 * n_dims)
        offset += 4 + 8 * n_dims + 12
        infos.append((name, tuple(int(d) for d in dims), type_id, rel))
    alignment = int(metadata.get("general.alignment", DEFAULT_ALIGNMENT)) or DEFAULT_ALIGNMENT
    data_start = -(-offset // alignment) * alignment
    tensors = [GGUFTensorInfo(n, s, t, data_start + rel) for n, s, t, rel in infos]
    return GGUFFile(path, metadata, tensors, len(buf))


def _read_string(buf, offset: int) -> tuple[str, int]:
    (size,) = struct.unpack_from("<Q", buf, offset)
    start = offset + 8
    if start + size > len(buf):
        raise ValueError("string runs past the end of the file")
    return buf[start:start + size].decode("utf-8", errors="replace"), start + size


def _read_value(buf, offset: int, value_type: int, keep: bool):
    """(value, next offset) of one GGUF value; arrays not kept are skipped cheaply when fixed-size."""
    if value_type == _STRING:
        return _read_string(buf, offset)
    if value_type == _ARRAY:
        item_type, count = struct.unpack_from("<IQ", buf, offset)
        offset += 12
        if item_type in _SCALAR_FORMATS:
            size = struct.calcsize("<" + _SCALAR_FORMATS[item_type]) * count
            if offset + size > len(buf):
                raise ValueError("array runs past the end of the file")
            values = (list(struct.unpack_from("<" + _SCALAR_FORMATS[item_type] * count, buf, offset))
                      if keep else None)
            return values, offset + size
        items = []
        for _ in range(count):
            item, offset = _read_value(buf, offset, item_type, keep)
            if keep:
                items.append(item)
        return (items if keep else None), offset
    if value_type not in _SCALAR_FORMATS:
        raise ValueError(f"unknown GGUF value type {value_type}")
    fmt = "<" + _SCALAR_FORMATS[value_type]
    return struct.unpack_from(fmt, buf, offset)[0], offset + struct.calcsize(fmt)


def tensor_bytes(info: GGUFTensorInfo, memmap: np.ndarray) -> np.ndarray:
    """The raw bytes of one tensor as uint8 rows ``[..., bytes_per_row]`` (what
    ``gguf.quants.dequantize`` expects). Raises ModelLoadError if the file is short."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    qtype = GGMLQuantizationType(info.type_id)
    block_size, type_size = GGML_QUANT_SIZES[qtype]
    row_elems = info.shape[0]
    if row_elems % block_size:
        raise ModelLoadError(f"tensor {info.name}: row of {row_elems} is not a multiple of {block_size}")
    row_bytes = row_elems // block_size * type_size
    num_rows = int(np.prod(info.shape[1:], dtype=np.int64)) if len(info.shape) > 1 else 1
    end = info.offset + row_bytes * num_rows
    if end > memmap.shape[0]:
        raise ModelLoadError(f"tensor {info.name} runs past the end of the file (truncated?)", param="model")
    return memmap[info.offset:end].reshape(*reversed(info.shape[1:]), row_bytes)
