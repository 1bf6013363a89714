"""The KV arithmetic of prefill/decode disaggregation: bytes moved per request, their time over
the link, the decode side's import, the stall a prompt puts on running streams in a unified
replica, and the prompt length where that stall equals the transfer (the threshold rule's
break-even). Pure functions over the planner's own KV formula and step-time roofline."""
from __future__ import annotations

import math

from kvserve.planner.dtypes import KVDType
from kvserve.planner.figures import Figure, fmt_bytes, fmt_rate, fmt_seconds
from kvserve.planner.hardware import HardwareSpec
from kvserve.planner.kv_memory import kv_bytes_per_token_per_gpu, model_kv_bytes_per_token
from kvserve.planner.models import ModelSpec
from kvserve.planner.roofline import CostModel, StepWork, chunk_attention, decode_work, step_time

CROSS_NODE_BW = 50e9      # bytes/s between nodes, as roofline.allreduce_s assumes


def full_blocks(prompt_tokens: float, block_size: int) -> int:
    """Full KV blocks of a prompt: the blocks the engine moves (the last partial block is
    computed on the decode side)."""
    return int(math.floor(prompt_tokens)) // block_size


def kv_link(hw: HardwareSpec, prefill_tp: int, decode_tp: int, override_bw: float | None = None) -> tuple[float, str]:
    """(bytes/s per link, why) for moving KV from a prefill to a decode instance.

    Both instances in one node (TP p + TP d <= GPUs per node): the node's interconnect; else the
    cross-node 50 GB/s of ``allreduce_s``. With no interconnect listed (a CPU host), the copy goes
    through shared memory at the memory bandwidth."""
    if override_bw is not None:
        return override_bw, f"--kv-link-gbs {fmt_rate(override_bw, 'B/s')}"
    if hw.interconnect_bw <= 0:
        return hw.mem_bandwidth, f"no interconnect listed: shared memory at {fmt_rate(hw.mem_bandwidth, 'B/s')}"
    if prefill_tp + decode_tp <= hw.gpus_per_node:
        return hw.interconnect_bw, (f"TP {prefill_tp} + TP {decode_tp} <= {hw.gpus_per_node} GPUs per node: "
                                    f"interconnect {fmt_rate(hw.interconnect_bw, 'B/s')}")
    bw = min(hw.interconnect_bw, CROSS_NODE_BW)
    return bw, (f"TP {prefill_tp} + TP {decode_tp} > {hw.gpus_per_node} GPUs per node: cross-node "
                f"{fmt_rate(bw, 'B/s')}")


def kv_transfer_bytes(model: ModelSpec, kv: KVDType, prompt_tokens: float, block_size: int,
                      name: str = "kv_transfer_bytes_per_request") -> Figure:
    """Bytes one request's prompt KV occupies in full blocks: blocks x block size x bytes per token."""
    per_token = model_kv_bytes_per_token(model, kv.bytes, kv.scale_bytes).value
    blocks = full_blocks(prompt_tokens, block_size)
    value = blocks * block_size * per_token
    return Figure(name, value, "B",
                  f"prompt {prompt_tokens:,.0f} tokens -> {blocks:,} full blocks x {block_size} tokens x "
                  f"{per_token:,.0f} B/token = {fmt_bytes(value)}")


def kv_transfer_s(num_bytes: float, links: int, link_bw: float, latency_s: float, link_why: str = "",
                  name: str = "kv_transfer_ms_per_request") -> Figure:
    """Seconds to move ``num_bytes`` over ``links`` parallel links (one per TP rank of the smaller
    instance) plus one latency; no bytes, no transfer. Value in ms."""
    value = 0.0 if num_bytes <= 0 else num_bytes / (links * max(link_bw, 1.0)) + latency_s
    why = f" ({link_why})" if link_why else ""
    return Figure(name, value * 1e3, "ms",
                  f"{fmt_bytes(num_bytes)} / ({links} links x {fmt_rate(link_bw, 'B/s')}){why} + latency "
                  f"{fmt_seconds(latency_s)} = {fmt_seconds(value)}")


def kv_import_s(model: ModelSpec, kv: KVDType, hw: HardwareSpec, decode_tp: int, prompt_tokens: float,
                block_size: int, name: str = "kv_import_ms_per_request") -> Figure:
    """Seconds a decode instance spends importing a prompt's blocks: read the staging copy and write
    the cache, 2 x bytes per GPU / (BW x KV efficiency) (docs/disaggregation.md). Value in ms."""
    per_gpu = kv_bytes_per_token_per_gpu(model, kv.bytes, decode_tp, kv.scale_bytes).value
    num_bytes = full_blocks(prompt_tokens, block_size) * block_size * per_gpu
    value = 2 * num_bytes / (hw.mem_bandwidth * hw.kv_efficiency)
    return Figure(name, value * 1e3, "ms",
                  f"2 (staging read + cache write) x {fmt_bytes(num_bytes)} per GPU at TP {decode_tp} / "
                  f"({fmt_rate(hw.mem_bandwidth, 'B/s')} x {hw.kv_efficiency:g}) = {fmt_seconds(value)}")


def chunk_added_s(cm: CostModel, batch: int, context: float, start: int, n: int) -> float:
    """Seconds a prefill chunk of ``n`` tokens (after ``start`` computed ones) adds to a decode step
    of ``batch`` sequences at ``context``: the step with the chunk minus the step without it."""
    plain = decode_work(batch, context)
    mixed = StepWork(batch + n, batch, plain.attn + (chunk_attention(start, n, cm.hw.kv_read_mode),))
    return step_time(cm, mixed).total_s - step_time(cm, plain).total_s


def chunk_budget(max_batched_tokens: int, batch: int) -> int:
    """Prompt tokens a step can carry beside ``batch`` decodes (decodes share the token budget)."""
    return max(1, max_batched_tokens - batch)


def added_prefill_s(cm: CostModel, batch: int, context: float, prompt_tokens: float, max_batched_tokens: int) -> float:
    """Seconds a prompt's chunks add, in total, to the steps of ``batch`` running streams."""
    budget = chunk_budget(max_batched_tokens, batch)
    total, done, remaining = 0.0, 0, int(math.ceil(prompt_tokens))
    while remaining > 0:
        n = min(budget, remaining)
        total += chunk_added_s(cm, batch, context, done, n)
        done, remaining = done + n, remaining - n
    return total


def stall_s(cm: CostModel, batch: int, context: float, prompt_tokens: float, max_batched_tokens: int) -> float:
    """Stream-seconds a prompt costs a unified replica: ``batch`` streams x the time its chunks add."""
    return batch * added_prefill_s(cm, batch, context, prompt_tokens, max_batched_tokens)


def transfer_seconds(model: ModelSpec, kv: KVDType, prompt_tokens: float, block_size: int, links: int,
                     link_bw: float, latency_s: float) -> float:
    """Seconds to move a prompt's full blocks (the plain number behind :func:`kv_transfer_s`)."""
    num_bytes = kv_transfer_bytes(model, kv, prompt_tokens, block_size).value
    return kv_transfer_s(num_bytes, links, link_bw, latency_s).value / 1e3


def breakeven_prompt_tokens(stall, transfer, lo: int, hi: int) -> int | None:
    """Smallest prompt length in [lo, hi] from which the stall outweighs the transfer, by bisection
    on stall(n) - transfer(n) (``lo`` if it already does, None if not even at ``hi``).

    On return n satisfies stall(n) >= transfer(n) and, unless n == lo, stall(n-1) < transfer(n-1)."""
    if stall(lo) >= transfer(lo):
        return lo
    if stall(hi) < transfer(hi):
        return None
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if stall(mid) >= transfer(mid) else (mid, hi)
    return hi


def tpot_break_prompt_tokens(cm: CostModel, batch: int, context: float, step_s: float, tpot_s: float,
                             max_batched_tokens: int) -> int | None:
    """Smallest prompt whose first chunk pushes the step of ``batch`` streams past ``tpot_s``
    (None when even a full chunk does not, or the plain step already misses it)."""
    budget = chunk_budget(max_batched_tokens, batch)

    def breaks(n: int) -> bool:
        return step_s + chunk_added_s(cm, batch, context, 0, min(n, budget)) > tpot_s

    if step_s > tpot_s or not breaks(budget):
        return None
    lo, hi = 0, budget          # breaks(lo) is False (no chunk), breaks(hi) True
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if breaks(mid) else (mid, hi)
    return hi
