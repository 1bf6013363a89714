"""KV cache sizing and allocation: the memory budget -> blocks arithmetic, logged at start.

A float KV dtype is a plain tensor ``[layers, 2, blocks, block_size, KVH, D]``; an 8-bit
one a :class:`kvserve.engine.kv.quantized.QuantizedKV` of the same shape (codes) with one
fp32 scale per (token, kv head). Both the target's and a draft model's KV come from
:func:`allocate_kv_tensors`.
"""
from __future__ import annotations

import logging
import os

import torch

from kvserve.config import ModelConfig
from kvserve.engine.kv.quantized import KV_FORMATS, QuantizedKV, allocate_quantized_kv
from kvserve.engine.kv.sizing import KVCachePlan, kv_cache_plan, kv_storage

logger = logging.getLogger("kvserve.kv_cache")

DEFAULT_CPU_KV_BYTES = 4 * 2**30
FLOAT_KV_DTYPES = {"float64": torch.float64, "float32": torch.float32, "bfloat16": torch.bfloat16,
                   "float16": torch.float16}


def default_kv_budget_bytes(device: torch.device, weight_bytes: int) -> int:
    """KV memory when none is configured: on CPU min(4 GiB, 20% of RAM); on GPU 85% of
    free memory after weights are loaded (``weight_bytes`` is already resident)."""
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        return int(free * 0.85)
    total_ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return int(min(DEFAULT_CPU_KV_BYTES, 0.2 * total_ram))


def kv_dtype_name(kv_dtype: "str | torch.dtype") -> str:
    """The KV dtype's name ("float32", "int8", ...); a torch float dtype is accepted too."""
    if isinstance(kv_dtype, torch.dtype):
        return str(kv_dtype).replace("torch.", "")
    return kv_dtype


def cache_kv_dtype(kv_cache) -> str:
    """The KV dtype name of an allocated cache (plain tensor or QuantizedKV)."""
    return kv_cache.format.name if isinstance(kv_cache, QuantizedKV) else kv_dtype_name(kv_cache.dtype)


def plan_kv_cache(config: ModelConfig, budget_bytes: int, kv_dtype: "str | torch.dtype", block_size: int,
                  max_model_len: int) -> KVCachePlan:
    """Blocks that fit ``budget_bytes`` for this model in KV dtype ``kv_dtype`` (a name:
    "float32", "int8", "fp8_e4m3", ...; the same function as the planner)."""
    storage = kv_storage(kv_dtype_name(kv_dtype))
    return kv_cache_plan(budget_bytes, config.num_layers, config.num_kv_heads, config.head_dim,
                         storage.element_bytes, block_size, max_model_len, storage.scale_bytes)


def allocate_kv_tensors(num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
                        kv_dtype: "str | torch.dtype", compute_dtype: torch.dtype, device: torch.device):
    """Zeroed cache ``[layers, 2, blocks, block_size, KVH, D]`` (zeros: padded reads stay
    finite): a plain tensor for a float KV dtype (it must be the compute dtype), else a
    QuantizedKV dequantising to ``compute_dtype``."""
    name = kv_dtype_name(kv_dtype)
    shape = (num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim)
    if name in KV_FORMATS:
        return allocate_quantized_kv(shape, name, compute_dtype, device)
    if name not in FLOAT_KV_DTYPES:
        raise ValueError(f"unknown KV dtype {name!r}; choose from {sorted({*FLOAT_KV_DTYPES, *KV_FORMATS})}")
    if FLOAT_KV_DTYPES[name] != compute_dtype:
        raise ValueError(f"a float KV cache must be in the compute dtype ({kv_dtype_name(compute_dtype)}), "
                         f"not {name}: use kv_cache_dtype='auto' or an 8-bit format")
    return torch.zeros(shape, dtype=compute_dtype, device=device)


def allocate_kv_cache(config: ModelConfig, plan: KVCachePlan, kv_dtype: "str | torch.dtype",
                      device: torch.device, compute_dtype: torch.dtype | None = None):
    """The model's cache for ``plan`` in KV dtype ``kv_dtype`` (see :func:`allocate_kv_tensors`);
    ``compute_dtype`` defaults to ``kv_dtype`` itself for a float KV dtype."""
    name = kv_dtype_name(kv_dtype)
    if compute_dtype is None:
        if name not in FLOAT_KV_DTYPES:
            raise ValueError(f"an {name} KV cache needs the compute dtype it dequantises to")
        compute_dtype = FLOAT_KV_DTYPES[name]
    return allocate_kv_tensors(config.num_layers, plan.num_blocks, plan.block_size, config.num_kv_heads,
                               config.head_dim, name, compute_dtype, device)


def read_kv_blocks(kv_cache, block_ids: list[int]) -> torch.Tensor:
    """A copy of the KV of ``block_ids``: ``[layers, 2, len(block_ids), block_size, KVH, D]``
    (every layer's K and V, in block order), for moving them to another engine. Plain
    float caches only: an 8-bit cache would need its scales moved too."""
    _check_plain(kv_cache)
    index = torch.tensor(block_ids, dtype=torch.long, device=kv_cache.device)
    return kv_cache.index_select(2, index)


def write_kv_blocks(kv_cache, block_ids: list[int], blocks: torch.Tensor) -> None:
    """Write ``blocks`` (``[layers, 2, len(block_ids), block_size, KVH, D]``, as
    :func:`read_kv_blocks` returns) into ``block_ids`` of ``kv_cache``."""
    _check_plain(kv_cache)
    expected = (*kv_cache.shape[:2], len(block_ids), *kv_cache.shape[3:])
    if tuple(blocks.shape) != expected:
        raise ValueError(f"KV blocks of shape {tuple(blocks.shape)} do not fit this cache ({expected})")
    index = torch.tensor(block_ids, dtype=torch.long, device=kv_cache.device)
    kv_cache.index_copy_(2, index, blocks.to(device=kv_cache.device, dtype=kv_cache.dtype))


def _check_plain(kv_cache) -> None:
    if isinstance(kv_cache, QuantizedKV):
        raise NotImplementedError("moving blocks of an 8-bit KV cache (codes + scales) is not supported")
