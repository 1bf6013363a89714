"""Accelerator catalog and hardware entries (built-in, custom JSON, or measured by ``kvserve profile``).

Figures are per device, dense (no 2:4 sparsity), from the vendors' datasheets;
memory is what the driver reports. Prices are illustrative on-demand $/GPU-hour
and meant to be overridden (``--price-per-hour`` or a custom JSON file); the
catalog itself is an immutable mapping.

Efficiency factors turn peaks into expected rates: ``mem_efficiency`` (weight
streaming; ``gemv_efficiency`` for one-token steps, whose matrix-vector kernels stream
weights without the GEMM packing CPUs do), ``kv_efficiency`` (KV reads in attention), ``flops_efficiency``
(GEMMs). Catalog defaults are typical published utilisations of tuned GPU
engines; ``kvserve profile`` replaces them with figures fitted to kvserve's own
measured step times on the local machine.
"""
from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Mapping

from kvserve.planner.errors import ImpossibleInputError, PlannerInputError

GB = 1e9
TB = 1e12
MiB = 2**20


@dataclass(frozen=True)
class HardwareSpec:
    """One accelerator (or a CPU) as the planner sees it. Units: bytes, bytes/s, FLOP/s, s, $."""

    name: str
    memory_bytes: float
    mem_bandwidth: float                       # peak bytes/s
    flops: Mapping[str, float]                 # dense peak FLOP/s by compute dtype
    interconnect_bw: float = 0.0               # bytes/s per direction per device (NVLink, IF, PCIe)
    interconnect_latency_s: float = 10e-6      # one small all-reduce / all-to-all
    all_to_all_bw: float = 0.0                 # bytes/s of expert parallelism's all-to-all as measured
                                               # (kvserve profile --expert-parallel); 0: interconnect_bw
    all_to_all_latency_s: float | None = None  # its fixed cost per call; None: interconnect_latency_s
    rank_skew_fixed_s: float = 0.0             # ranks' arrival spread per collective, fixed part
    rank_jitter_cv: float = 0.0                # a rank's compute jitter between collectives (std / mean)
    dispatch_s: float = 0.0                    # per forward: the workers' lag receiving the step's work
                                               # (all three: planner/rank_skew.py; 0 where unmeasured)
    price_per_hour: float = 0.0                # $ per device-hour
    gpus_per_node: int = 8
    mem_efficiency: float = 0.80
    gemv_efficiency: float | None = None       # weight streaming when a step has one token
                                               # (matrix-vector kernels); None = mem_efficiency
    kv_efficiency: float = 0.80
    flops_efficiency: float = 0.60
    step_overhead_s: float = 0.0               # fixed host time per engine step
    seq_overhead_s: float = 0.0                # host time per sequence per step
    request_overhead_s: float = 0.0            # host time per request (admission, output)
    memory_utilization: float = 0.90           # fraction of memory the engine may use
    runtime_overhead_bytes: float = 1.0 * 2**30   # CUDA context, graphs, comm buffers
    kv_read_mode: str = "sum"                  # "sum": kernels read each sequence's own KV;
                                               # "padded": batch padded to the longest sequence
    source: str = ""
    calibration: Mapping[str, Any] = field(default_factory=dict, compare=False)

    def all_to_all_link(self) -> tuple[float, float]:
        """(bytes/s, seconds per call) of one all-to-all within a node: the fitted figures where
        ``kvserve profile --expert-parallel`` measured them, else the interconnect's."""
        bw = self.all_to_all_bw or self.interconnect_bw
        latency = self.interconnect_latency_s if self.all_to_all_latency_s is None else self.all_to_all_latency_s
        return bw, latency

    def weight_efficiency(self, num_tokens: int) -> float:
        """Weight-streaming efficiency of a step with ``num_tokens`` tokens."""
        if num_tokens == 1 and self.gemv_efficiency is not None:
            return self.gemv_efficiency
        return self.mem_efficiency

    def flops_for(self, compute: str) -> tuple[float, str]:
        """Peak FLOP/s for ``compute`` dtype, falling back to bf16 then fp32 (weight-only quant)."""
        for key in (compute, "bf16", "fp16", "fp32"):
            if self.flops.get(key):
                return float(self.flops[key]), key
        raise PlannerInputError(f"hardware {self.name!r} lists no FLOP/s", param="gpu")


def _gpu(name: str, mem_mib: float, bw: float, flops: dict, link: float, price: float, source: str,
         **kw) -> HardwareSpec:
    return HardwareSpec(name=name, memory_bytes=mem_mib * MiB, mem_bandwidth=bw,
                        flops=MappingProxyType(flops), interconnect_bw=link, price_per_hour=price,
                        source=source, **kw)


_CATALOG = [
    _gpu("a100-80gb", 81920, 2.039 * TB, {"bf16": 312e12, "fp16": 312e12, "int8": 624e12, "fp32": 19.5e12},
         300 * GB, 1.79, "NVIDIA A100 datasheet (SXM4 80GB): 2,039 GB/s, 312 TFLOPS bf16 dense, "
         "NVLink3 600 GB/s bidirectional; no fp8 (fp8 weights run weight-only on bf16 tensor cores)"),
    _gpu("h100-sxm", 81559, 3.35 * TB, {"bf16": 989.4e12, "fp16": 989.4e12, "fp8": 1978.9e12,
                                        "int8": 1978.9e12, "fp32": 66.9e12},
         450 * GB, 2.49, "NVIDIA H100 datasheet (SXM5 80GB): 3.35 TB/s, 989 TFLOPS bf16 / 1,979 fp8 dense, "
         "NVLink4 900 GB/s bidirectional"),
    _gpu("h200", 143771, 4.8 * TB, {"bf16": 989.4e12, "fp16": 989.4e12, "fp8": 1978.9e12,
                                    "int8": 1978.9e12, "fp32": 66.9e12},
         450 * GB, 3.49, "NVIDIA H200 datasheet (SXM 141GB): 4.8 TB/s, H100 compute, NVLink4 900 GB/s"),
    _gpu("b200", 183359, 8.0 * TB, {"bf16": 2.25e15, "fp16": 2.25e15, "fp8": 4.5e15, "int8": 4.5e15,
                                    "fp32": 75e12},
         900 * GB, 5.99, "NVIDIA HGX B200 datasheet (180GB): 8 TB/s, 2.25 PFLOPS bf16 / 4.5 fp8 dense, "
         "NVLink5 1.8 TB/s bidirectional"),
    _gpu("l4", 23034, 300 * GB, {"bf16": 121e12, "fp16": 121e12, "fp8": 242.5e12, "int8": 242.5e12,
                                 "fp32": 30.3e12},
         32 * GB, 0.80, "NVIDIA L4 datasheet (24GB GDDR6): 300 GB/s, 121 TFLOPS bf16 / 242.5 fp8 dense, "
         "PCIe Gen4 x16 (no NVLink)", interconnect_latency_s=25e-6, runtime_overhead_bytes=0.75 * 2**30),
    _gpu("mi300x", 196608, 5.3 * TB, {"bf16": 1307.4e12, "fp16": 1307.4e12, "fp8": 2614.9e12,
                                      "int8": 2614.9e12, "fp32": 163.4e12},
         448 * GB, 3.49, "AMD Instinct MI300X datasheet (192GB HBM3): 5.3 TB/s, 1,307 TFLOPS bf16 / 2,615 fp8 "
         "dense, Infinity Fabric 7 x 128 GB/s bidirectional"),
]

CATALOG = MappingProxyType({h.name: h for h in _CATALOG})


def default_hardware_dir() -> str:
    """``~/.cache/kvserve/hardware`` (where ``kvserve profile`` saves entries)."""
    return os.path.join(os.path.expanduser("~"), ".cache", "kvserve", "hardware")


def hardware_to_dict(hw: HardwareSpec) -> dict:
    """JSON-ready dict of a hardware entry."""
    d = {f.name: getattr(hw, f.name) for f in dataclasses.fields(HardwareSpec)}
    d["flops"] = dict(hw.flops)
    d["calibration"] = json.loads(json.dumps(dict(hw.calibration), default=str))
    return d


def hardware_from_dict(d: Mapping[str, Any]) -> HardwareSpec:
    """Build and check a hardware entry from a dict (unknown keys are refused)."""
    known = {f.name for f in dataclasses.fields(HardwareSpec)}
    unknown = set(d) - known
    if unknown:
        raise PlannerInputError(f"unknown hardware fields {sorted(unknown)}; known: {sorted(known)}",
                                param="gpu_file")
    try:
        values = dict(d)
        values["flops"] = MappingProxyType({k: float(v) for k, v in dict(d.get("flops", {})).items()})
        values["calibration"] = MappingProxyType(dict(d.get("calibration", {})))
        hw = HardwareSpec(**values)
    except TypeError as exc:
        raise PlannerInputError(f"hardware entry is incomplete: {exc}", param="gpu_file") from exc
    validate_hardware(hw)
    return hw


def validate_hardware(hw: HardwareSpec) -> None:
    """Refuse entries no machine can have: non-positive capacity or rates, efficiencies above 1."""
    if hw.memory_bytes <= 0 or hw.mem_bandwidth <= 0 or not any(v > 0 for v in hw.flops.values()):
        raise ImpossibleInputError(f"hardware {hw.name!r} needs positive memory, bandwidth and FLOP/s",
                                   param="gpu")
    for name in ("mem_efficiency", "gemv_efficiency", "kv_efficiency", "flops_efficiency",
                 "memory_utilization"):
        value = getattr(hw, name)
        if value is None and name == "gemv_efficiency":
            continue
        if not 0 < value <= 1:
            raise ImpossibleInputError(f"{name} = {value} for {hw.name!r}: an efficiency must be in (0, 1] "
                                       "(a machine cannot beat its own peak)", param=name)
    if hw.kv_read_mode not in ("sum", "padded"):
        raise PlannerInputError(f"kv_read_mode must be 'sum' or 'padded', not {hw.kv_read_mode!r}",
                                param="kv_read_mode")


def load_hardware_file(path: str) -> HardwareSpec:
    """Read a hardware entry saved by ``kvserve profile`` or written by hand."""
    try:
        with open(path, encoding="utf-8") as fh:
            data = json.load(fh)
    except (OSError, json.JSONDecodeError) as exc:
        raise PlannerInputError(f"cannot read hardware file {path!r}: {exc}", param="gpu_file") from exc
    return hardware_from_dict(data)


def save_hardware_file(hw: HardwareSpec, path: str) -> str:
    """Write ``hw`` as JSON to ``path`` (folders created); returns the path."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w", encoding="utf-8") as fh:
        json.dump(hardware_to_dict(hw), fh, indent=2, sort_keys=True)
        fh.write("\n")
    return path


def resolve_hardware(name: str | None = None, path: str | None = None,
                     price_per_hour: float | None = None) -> HardwareSpec:
    """A catalog entry, ``local`` (the profiled entry), or a JSON file; price optionally replaced."""
    if path:
        hw = load_hardware_file(path)
    elif name and name.lower() == "local":
        local = os.path.join(default_hardware_dir(), "local.json")
        if not os.path.exists(local):
            raise PlannerInputError(f"no profiled hardware at {local}; run `kvserve profile` first",
                                    param="gpu")
        hw = load_hardware_file(local)
    elif name and name.endswith(".json") and os.path.exists(name):
        hw = load_hardware_file(name)
    else:
        key = (name or "h100-sxm").lower()
        if key not in CATALOG:
            raise PlannerInputError(f"unknown GPU {name!r}; choose from {sorted(CATALOG)}, `local`, "
                                    "or --gpu-file PATH", param="gpu")
        hw = CATALOG[key]
    if price_per_hour is not None:
        if price_per_hour < 0:
            raise PlannerInputError("price per hour cannot be negative", param="price_per_hour")
        hw = dataclasses.replace(hw, price_per_hour=float(price_per_hour))
    return hw
