"""One way to turn a checkpoint into a ready model on a device: the target's and a
draft model's load are the same steps."""
from __future__ import annotations

import logging

import torch

logger = logging.getLogger("kvserve.engine")

TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype of a resolved dtype name (``ResolvedConfig.dtype``)."""
    return TORCH_DTYPES[name]


def load_model(checkpoint, device: torch.device, dtype: torch.dtype, quantization: str = "none",
               bandwidth: float | None = None, transform=None):
    """Build the checkpoint's architecture, load its tensors, move it to ``device`` in
    ``dtype`` (rotary tables stay fp32), quantise its decoder projections
    (``quantization`` "int8" / "int4", ``kvserve.quant``) and pack the float ones for
    that device. The checkpoint's tensors are released as they are consumed. The log's
    bs=1 bound uses ``bandwidth`` (bytes/s; measured here when None). ``transform``
    (model -> model, e.g. a tensor-parallel shard) runs on the plain model on its device,
    before quantisation and packing."""
    from kvserve.engine.bandwidth import decode_bound_text, measure_copy_bandwidth
    from kvserve.models.registry import build_model

    model = build_model(checkpoint.config)
    model.load_weights(checkpoint.tensors)
    checkpoint.tensors = {}
    model = model.to(device=device, dtype=dtype).eval()
    model.rotary.float()
    if transform is not None:
        model = transform(model)
    sources = {}
    if quantization != "none":
        from kvserve.quant.transform import quantize_projections
        sources = quantize_projections(model, quantization, device)
    layouts = model.pack_weights()
    logger.info("weights of %s (%s, quantization %s%s): %s; layouts %s",
                checkpoint.config.name or checkpoint.config.architecture, str(dtype).removeprefix("torch."),
                quantization, f" {sources}" if sources else "",
                decode_bound_text(model.weight_bytes(), model.decode_read_bytes(),
                                  bandwidth or measure_copy_bandwidth(device)), layouts)
    model.weight_layouts = layouts
    return model
