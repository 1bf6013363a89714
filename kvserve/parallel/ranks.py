"""The worker processes of ranks 1..N-1 of a tensor-parallel replica, and the commands
rank 0 (the engine process) sends them.

Rank 0 owns the scheduler; every step it broadcasts what the runner needs to build the
same tensors (``ForwardWork``: token ids, positions, block tables — not the requests'
sampling state), then every rank runs the same forward. Commands::

    ("forward", [ForwardWork]) build inputs, run the forward (the worker keeps its hidden states)
    ("project", rows)          project rows (indices or a slice) of the last forward's hidden states
                               on this rank's vocabulary rows (every rank holds the same hidden bits)
    ("logits", hidden rows)    project rank-0's hidden rows on each rank's vocabulary rows
    ("copy", [(src, dst)])     copy KV blocks (copy-on-write at a fork)
    ("stop", None)             leave the loop

A worker is a fresh interpreter (``python -m kvserve.parallel.ranks``), loads the
checkpoint itself, shards it, allocates its KV heads' cache once rank 0 has sized it, and
exits when rank 0 sends ``stop``, when rank 0's process is gone, or when a collective fails.
"""
from __future__ import annotations

import dataclasses
import json
import logging
import os
import subprocess
import sys
import threading
import time
from dataclasses import dataclass

logger = logging.getLogger("kvserve.parallel")


@dataclass(frozen=True)
class RankSpec:
    """What a worker needs to build its shard: the checkpoint and how to load it, the
    replica's layout, and rank 0's store file."""

    model: str | None
    device: str                 # "cpu" or "cuda" (rank r uses cuda:r)
    dtype: str                  # resolved compute dtype name
    quantization: str
    kv_cache_dtype: str
    block_size: int
    attention_backend: str
    num_threads: int | None
    world_size: int
    store_path: str
    bandwidth: float            # bytes/s, rank 0's measurement (for the log only)
    lora_slots: int = 0         # LoRA: resident adapter slots (0: LoRA off) and their largest rank
    lora_max_rank: int = 0


def rank_device(device: str, rank: int):
    """The torch device of ``rank``: its own GPU, or the CPU."""
    import torch
    return torch.device("cuda", rank) if device == "cuda" else torch.device("cpu")


def _exit_with_parent(parent_pid: int) -> None:
    """A daemon thread: end this worker when rank 0's process is gone."""
    def watch():
        while os.getppid() == parent_pid:
            time.sleep(0.5)
        os._exit(1)
    threading.Thread(target=watch, daemon=True, name="kvserve-rank-watchdog").start()


def worker_main(rank: int, spec: RankSpec, parent_pid: int) -> None:
    """Entry point of rank ``rank`` (>= 1): build the shard, then serve rank 0's commands."""
    import torch

    from kvserve.engine.kv.tensors import allocate_kv_cache
    from kvserve.engine.model_loading import load_model, torch_dtype
    from kvserve.engine.model_runner import ModelRunner
    from kvserve.engine.startup_gc import freeze_startup_objects
    from kvserve.loader import load_checkpoint
    from kvserve.parallel.group import RankGroup, join_store
    from kvserve.parallel.tensor_parallel import TensorParallelModel

    _exit_with_parent(parent_pid)
    if spec.num_threads:
        torch.set_num_threads(spec.num_threads)
    device, dtype = rank_device(spec.device, rank), torch_dtype(spec.dtype)
    group = RankGroup(join_store(spec.world_size, spec.store_path), rank, spec.world_size, device.type)
    try:
        model = load_model(load_checkpoint(spec.model), device, dtype, spec.quantization, spec.bandwidth,
                           transform=lambda m: TensorParallelModel(m, group, spec.quantization))
        kv_plan = group.broadcast_object()
        kv_cache = allocate_kv_cache(model.rank_config, kv_plan, spec.kv_cache_dtype, device, dtype)
        backend = attention_backend(spec.attention_backend, model.rank_config)
        handlers, batch = {}, None
        if spec.lora_slots:
            from kvserve.parallel.lora_shards import RankAdapters
            adapters = RankAdapters(model, spec.lora_slots, spec.lora_max_rank, device, dtype, rank, spec.world_size)
            handlers["lora_write"], batch = adapters.write, adapters.batch
        freeze_startup_objects()
        serve_commands(group, ModelRunner(model, kv_cache, backend, spec.block_size, device, batch_context=batch),
                       handlers)
    except Exception:               # rank 0 gone mid-collective, or a broken shard: leave loudly
        logger.exception("tensor-parallel rank %d stops", rank)
        raise


def attention_backend(name: str, rank_config):
    """The attention backend for one rank's heads."""
    from kvserve.attention import get_backend
    return get_backend(name, rank_config.num_heads, rank_config.num_kv_heads, rank_config.head_dim)


def serve_commands(group, runner, handlers: dict | None = None) -> None:
    """Run rank 0's commands on this rank's ``runner`` until ``stop``. ``draft_forward``
    runs the shard's first layers (a self-draft) on a runner of the truncated view, built
    on first use and sharing the runner's KV tensor and attention backend; ``handlers``
    (command -> callable of its argument) serves the rest (``lora_write``)."""
    import torch

    from kvserve.engine.model_runner import ModelRunner
    from kvserve.speculative.draft import truncated_model
    draft_runners: dict[int, ModelRunner] = {}
    hidden = None                       # the last forward's (or draft forward's) hidden states
    while True:
        command, arg = group.broadcast_object()
        if command == "stop":
            return
        with torch.inference_mode():
            if command == "forward":
                hidden = runner._forward(arg)[0]
            elif command == "draft_forward":
                layers, works = arg
                if layers not in draft_runners:
                    draft_runners[layers] = ModelRunner(truncated_model(runner.model, layers), runner.kv_cache[:layers],
                                                        runner.backend, runner.block_size, runner.device)
                hidden = draft_runners[layers]._forward(works)[0]
            elif command == "project":
                runner.logits(hidden[arg if isinstance(arg, slice) else torch.tensor(arg, device=hidden.device)])
            elif command == "logits":
                runner.logits(arg)
            elif command == "copy":
                runner.copy_blocks(arg)
            elif handlers and command in handlers:
                handlers[command](arg)
            else:
                raise RuntimeError(f"unknown rank command {command!r}")


def start_workers(spec: RankSpec) -> list[subprocess.Popen]:
    """Start ranks 1..world_size-1 as fresh interpreters (``python -m kvserve.parallel.ranks``:
    no re-import of the caller's main module, no inherited threads); they join rank 0's store."""
    args = json.dumps(dataclasses.asdict(spec))
    return [subprocess.Popen([sys.executable, "-m", "kvserve.parallel.ranks", str(rank), args, str(os.getpid())])
            for rank in range(1, spec.world_size)]


def main(argv: list[str] | None = None) -> int:
    """``python -m kvserve.parallel.ranks RANK SPEC_JSON PARENT_PID``."""
    rank, spec, parent = (argv if argv is not None else sys.argv[1:])
    logging.basicConfig(level=logging.WARNING, format=f"%(asctime)s rank {rank} %(levelname)s %(name)s: %(message)s")
    worker_main(int(rank), RankSpec(**json.loads(spec)), int(parent))
    return 0


if __name__ == "__main__":
    sys.exit(main())
