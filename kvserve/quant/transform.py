"""The load-time pass that quantises a model's decoder projections (beside
``Projection.pack``, which lays out the float ones that remain).

Every projection of every decoder layer (fused q/k/v, o, fused gate/up, down) gets a
kernel of the chosen scheme; its weight comes from the loader's quantised blocks when
the checkpoint stored it in that form (no float32 detour), else it is quantised from
the float weight. The embedding table and the vocabulary head stay in the model dtype:
on the default model the head is 28 M of the 135 M weights; at one row it ran 10.5 ms in
float32 (oneDNN), 7.6 ms as int8 and 4.7 ms as int4, but the GGUF stores it as Q8_0 with
a scale per 32, so either kernel would re-round it (docs/quantization.md).
"""
from __future__ import annotations

from kvserve.models.projection import Projection
from kvserve.quant.formats import as_format
from kvserve.quant.kernels import make_kernel

SCHEMES = ("int8", "int4")


def quantize_projections(model, scheme: str, device) -> dict[str, int]:
    """Swap each decoder projection's weight for a ``scheme`` kernel on ``device``.
    Returns how many came straight from the checkpoint's blocks (``direct``) and how
    many were quantised from float (``quantized``)."""
    if scheme not in SCHEMES:
        raise ValueError(f"unknown weight quantisation {scheme!r}; choose from {SCHEMES}")
    counts = {"direct": 0, "quantized": 0}
    for layer in model.layers:
        for proj in layer.modules():
            if not isinstance(proj, Projection):
                continue
            source = proj.quantized_weight if proj.quantized_weight is not None else proj.weight
            weight = as_format(source, scheme)
            counts["direct" if weight is source else "quantized"] += 1
            proj.use_kernel(make_kernel(weight, device))
    return counts


def direct_types(scheme: str) -> tuple[str, ...]:
    """GGUF block types the loader should keep quantised for ``scheme``."""
    from kvserve.quant.gguf_blocks import DIRECT_TYPES
    return DIRECT_TYPES.get(scheme, ())
