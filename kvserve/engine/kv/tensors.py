"""KV cache sizing and allocation: the memory budget -> blocks arithmetic, logged at start."""
from __future__ import annotations

import logging
import os

import torch

from kvserve.config import ModelConfig
from kvserve.engine.kv.sizing import KVCachePlan, kv_cache_plan

logger = logging.getLogger("kvserve.kv_cache")

DEFAULT_CPU_KV_BYTES = 4 * 2**30


def default_kv_budget_bytes(device: torch.device, weight_bytes: int) -> int:
    """KV memory when none is configured: on CPU min(4 GiB, 20% of RAM); on GPU 85% of
    free memory after weights are loaded (``weight_bytes`` is already resident)."""
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        return int(free * 0.85)
    total_ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return int(min(DEFAULT_CPU_KV_BYTES, 0.2 * total_ram))


def plan_kv_cache(config: ModelConfig, budget_bytes: int, dtype: torch.dtype, block_size: int,
                  max_model_len: int) -> KVCachePlan:
    """Blocks that fit ``budget_bytes`` for this model (same function as the planner)."""
    dtype_bytes = torch.empty((), dtype=dtype).element_size()
    return kv_cache_plan(budget_bytes, config.num_layers, config.num_kv_heads, config.head_dim,
                         dtype_bytes, block_size, max_model_len)


def allocate_kv_cache(config: ModelConfig, plan: KVCachePlan, dtype: torch.dtype,
                      device: torch.device) -> torch.Tensor:
    """Zeroed cache [layers, 2, blocks, block_size, KVH, D] (zeros: padded reads stay finite)."""
    shape = (config.num_layers, 2, plan.num_blocks, plan.block_size, config.num_kv_heads, config.head_dim)
    return torch.zeros(shape, dtype=dtype, device=device)
