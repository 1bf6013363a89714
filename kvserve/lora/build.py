"""Wire LoRA into a loaded model: slots, the transform, the batch context, the manager."""
from __future__ import annotations

import logging

import torch

from kvserve.config import ModelConfig
from kvserve.engine.config import LoRASettings
from kvserve.errors import InvalidRequestError
from kvserve.lora.batch import LoRABatch
from kvserve.lora.layer import apply_lora
from kvserve.lora.manager import LoRAManager
from kvserve.lora.slots import AdapterSlots

logger = logging.getLogger("kvserve.lora")


def build_lora(settings: LoRASettings, model, model_config: ModelConfig, device: torch.device,
               dtype: torch.dtype, slots: AdapterSlots | None = None) -> tuple[LoRAManager, LoRABatch]:
    """Preallocate ``max_loras`` slots (or take ``slots``: a tensor-parallel shard's), wrap the
    model's projections, load the start-up adapters (a bad one is an ``AdapterLoadError`` at
    start). Mixture-of-experts models have no LoRA roles for their expert MLPs: refused."""
    if model_config.moe is not None:
        raise InvalidRequestError(f"LoRA is not supported for the mixture-of-experts architecture "
                                  f"{model_config.architecture!r}", param="enable_lora")
    slots = slots or AdapterSlots(model_config, settings.max_loras, settings.max_lora_rank, device, dtype)
    manager = LoRAManager(model_config, slots, settings.max_cpu_loras)
    batch = LoRABatch(manager.slot_of, device)
    apply_lora(model, slots, batch)
    logger.info("LoRA: %d resident slots of rank <= %d (%.1f MB each, %.1f MB in all), host tier %d adapters",
                slots.num_slots, slots.max_rank, slots.slot_nbytes / 1e6, slots.nbytes / 1e6,
                manager.max_host)
    for name, path in settings.lora_modules:
        manager.load(name, path)
    return manager, batch
