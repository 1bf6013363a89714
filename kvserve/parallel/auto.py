"""``--tensor-parallel-size auto``: the smallest TP whose per-GPU weights, reserve and KV for
one full-context sequence fit, by the planner's own memory functions (``valid_tp_degrees``,
``replica_memory``), so the engine and ``kvserve plan`` agree by construction.

On a CPU every rank shares one host's memory: more ranks hold no more, so ``auto`` is 1.
"""
from __future__ import annotations

import dataclasses

from kvserve.errors import InvalidRequestError
from kvserve.planner.dtypes import kv_dtype, weight_dtype
from kvserve.planner.hardware import CATALOG, HardwareSpec
from kvserve.planner.memory import replica_memory, valid_tp_degrees, weight_bytes
from kvserve.planner.models import ModelSpec
from kvserve.planner.roofline import cost_model


def smallest_fitting_tp(model: ModelSpec, hw: HardwareSpec, weight_dtype_name: str, kv_dtype_name: str,
                        context: int, max_tp: int, block_size: int = 16, max_batched_tokens: int = 8192,
                        max_num_seqs: int = 256) -> tuple[int, str]:
    """(TP, the arithmetic that chose it): the smallest valid TP <= ``max_tp`` where one
    ``context``-token sequence's KV fits beside the weights and the reserve on each GPU.
    Dtype names are the engine's or the planner's ("bfloat16" or "bf16"). Raises
    ``InvalidRequestError`` with each degree's arithmetic when none fits."""
    wd, kd = weight_dtype(weight_dtype_name), kv_dtype(kv_dtype_name)
    wbytes = weight_bytes(model, wd).value
    act_bytes = cost_model(model, hw, wd, kd, 1).act_bytes        # as the planner's replica memory
    tried = []
    for tp in valid_tp_degrees(model, max_tp):
        mem = replica_memory(model, hw, wbytes, kd.bytes, tp, context, block_size, max_batched_tokens,
                             max_num_seqs, act_bytes, kd.scale_bytes)
        if mem.fits:
            return tp, f"auto: smallest TP that fits one {context:,}-token sequence; {mem.arithmetic}"
        tried.append(mem.arithmetic)
    raise InvalidRequestError(f"no tensor-parallel size up to {max_tp} fits {model.name} on {hw.name}: "
                              + "; ".join(tried or ["no TP degree divides its heads"]),
                              param="tensor_parallel_size")


def local_gpu_hardware() -> HardwareSpec:
    """This machine's GPU as a planner entry: the catalogue's figures for a matching name
    (else the H100's), with the memory and GPU count torch reports."""
    import torch
    props = torch.cuda.get_device_properties(0)
    name = props.name.lower()
    base = next((hw for key, hw in CATALOG.items() if key.split("-")[0] in name), CATALOG["h100-sxm"])
    return dataclasses.replace(base, name=props.name, memory_bytes=float(props.total_memory),
                               gpus_per_node=torch.cuda.device_count())


def pick_tensor_parallel(config, device: str, dtype: str, kv_cache_dtype: str, max_model_len: int,
                         block_size: int, max_num_batched_tokens: int, max_num_seqs: int) -> tuple[int, str]:
    """(TP, why) for ``auto`` on this machine (``config`` is the engine's ``ModelConfig``)."""
    if device != "cuda":
        return 1, "auto: CPU ranks share one host's memory, so more ranks hold no more weights or KV: TP 1"
    from kvserve.planner.profile import model_from_engine
    hw = local_gpu_hardware()
    return smallest_fitting_tp(model_from_engine(config), hw, dtype, kv_cache_dtype, max_model_len,
                               hw.gpus_per_node, block_size, max_num_batched_tokens, max_num_seqs)
