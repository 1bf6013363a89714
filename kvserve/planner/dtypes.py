"""Storage types for weights and the KV cache: bytes per element, scales included.

KV entries take their bytes from the engine's own table (``kvserve.engine.kv.sizing.KV_STORAGE``):
the 8-bit KV formats keep one fp32 scale (4 B) per (token, kv head), as the engine stores them.

Quantised weights carry scales. We count them as stated in each entry:
``int4`` = 4-bit weights + one fp16 scale and one 4-bit zero point per group of
128 (the AWQ / GPTQ g128 layout); ``int8`` / ``fp8`` = one fp32 scale per output
channel (per-channel W8A8), i.e. 32 bits per ``in_features`` weights.
Embeddings and the LM head stay in bf16 for 8- and 4-bit weights (as vLLM does).
"""
from __future__ import annotations

from dataclasses import dataclass
from types import MappingProxyType

from kvserve.engine.kv.sizing import kv_storage
from kvserve.planner.errors import PlannerInputError


@dataclass(frozen=True)
class WeightDType:
    """How one weight is stored: ``bits`` plus ``scale_bits`` per group of weights.

    ``group_size`` None means per output channel: one scale per ``in_features`` weights.
    ``compute`` names the FLOP/s column of the hardware used for this dtype's GEMMs.
    """

    name: str
    bits: float
    scale_bits: float = 0.0
    group_size: int | None = None
    compute: str = "bf16"
    quantized: bool = False

    def bytes_per_weight(self, in_features: int) -> float:
        """Bytes per weight including its share of scales (``in_features`` for per-channel)."""
        group = self.group_size if self.group_size else in_features
        return (self.bits + (self.scale_bits / group if self.scale_bits else 0.0)) / 8.0

    def describe(self, in_features: int) -> str:
        """``4 bits + 20 scale bits / 128 = 0.5195 B``."""
        per = self.bytes_per_weight(in_features)
        if not self.scale_bits:
            return f"{self.bits:g} bits = {per:g} B"
        group = self.group_size if self.group_size else in_features
        return f"({self.bits:g} bits + {self.scale_bits:g} scale bits / {group}) / 8 = {per:.4g} B"


@dataclass(frozen=True)
class KVDType:
    """One KV-cache element: ``bytes`` each, plus ``scale_bytes`` per (token, kv head)
    (the 8-bit formats' fp32 scale; 0 for the float formats)."""

    name: str
    bytes: float
    scale_bytes: float = 0.0


def _kv_entry(name: str, engine_name: str) -> KVDType:
    """The planner's KV dtype ``name`` with the engine's storage for ``engine_name``."""
    storage = kv_storage(engine_name)
    return KVDType(name, storage.element_bytes, storage.scale_bytes)


WEIGHT_DTYPES = MappingProxyType({
    "fp32": WeightDType("fp32", 32, compute="fp32"),
    "bf16": WeightDType("bf16", 16),
    "fp16": WeightDType("fp16", 16),
    "fp8": WeightDType("fp8", 8, scale_bits=32, compute="fp8", quantized=True),
    "int8": WeightDType("int8", 8, scale_bits=32, compute="int8", quantized=True),
    "int4": WeightDType("int4", 4, scale_bits=20, group_size=128, compute="bf16", quantized=True),
})

KV_DTYPES = MappingProxyType({
    "fp32": _kv_entry("fp32", "float32"),
    "bf16": _kv_entry("bf16", "bfloat16"),
    "fp16": _kv_entry("fp16", "float16"),
    "fp8": _kv_entry("fp8", "fp8_e4m3"),
    "fp8_e5m2": _kv_entry("fp8_e5m2", "fp8_e5m2"),
    "int8": _kv_entry("int8", "int8"),
})

ALIASES = MappingProxyType({"float32": "fp32", "bfloat16": "bf16", "float16": "fp16",
                            "fp8_e4m3": "fp8", "float8": "fp8", "w8a8": "int8", "w4a16": "int4",
                            "awq": "int4", "gptq": "int4"})


def weight_dtype(name: str) -> WeightDType:
    """The weight dtype called ``name`` (case-insensitive, common aliases accepted)."""
    key = ALIASES.get(name.lower(), name.lower())
    if key not in WEIGHT_DTYPES:
        raise PlannerInputError(f"unknown weight dtype {name!r}; choose from {sorted(WEIGHT_DTYPES)}",
                                param="weight_dtype")
    return WEIGHT_DTYPES[key]


def kv_dtype(name: str) -> KVDType:
    """The KV-cache dtype called ``name``."""
    key = ALIASES.get(name.lower(), name.lower())
    if key not in KV_DTYPES:
        raise PlannerInputError(f"unknown KV dtype {name!r}; choose from {sorted(KV_DTYPES)}",
                                param="kv_dtype")
    return KV_DTYPES[key]
