"""Starting a tensor-parallel replica from the composition root (``kvserve.builder``):
the workers, rank 0's group, the shard transform and the driving runner."""
from __future__ import annotations

import functools
import logging

from kvserve.parallel.group import RankGroup, open_store
from kvserve.parallel.ranks import RankSpec, start_workers
from kvserve.parallel.runner import TensorParallelDraftRunner, TensorParallelRunner
from kvserve.parallel.tensor_parallel import TensorParallelModel, check_tensor_parallel

logger = logging.getLogger("kvserve.parallel")


def check_layout(resolved, model_config) -> None:
    """Refuse, with the reason, a tensor-parallel size the model's heads, KV heads, MLP
    width or experts cannot be split by (``check_tensor_parallel``)."""
    check_tensor_parallel(model_config, resolved.tensor_parallel_size)


class TensorParallelLaunch:
    """Ranks 1..N-1 started, rank 0's group joined; ``shard`` is the load transform,
    ``share_kv_plan`` sends rank 0's KV sizing, ``runner`` builds the driving runner."""

    def __init__(self, model_path: str | None, resolved, bandwidth: float):
        tp = resolved.tensor_parallel_size
        store, store_path = open_store(tp)
        lora = resolved.lora
        spec = RankSpec(model_path, resolved.device, resolved.dtype, resolved.quantization,
                        resolved.kv_cache_dtype, resolved.block_size, resolved.attention_backend,
                        resolved.num_threads, tp, store_path, bandwidth,
                        lora.max_loras if lora else 0, lora.max_lora_rank if lora else 0)
        self.quantization = resolved.quantization
        self.workers = start_workers(spec)
        try:
            self.group = RankGroup(store, 0, tp, resolved.device)
        except Exception:
            self._terminate()
            raise
        logger.info("tensor parallel: %d ranks (%s), gloo/NCCL on 127.0.0.1, rendezvous file %s", tp,
                    resolved.tensor_parallel_reason, store_path)

    def shard(self, model) -> TensorParallelModel:
        """Rank 0's shard of the loaded plain model."""
        return TensorParallelModel(model, self.group, self.quantization)

    def share_kv_plan(self, kv_plan) -> None:
        """Every rank allocates ``kv_plan.num_blocks`` blocks of its own KV heads."""
        self.group.broadcast_object(kv_plan)

    def runner(self, *args, **kwargs) -> TensorParallelRunner:
        """The runner on rank 0 that drives the others (``ModelRunner``'s arguments)."""
        return TensorParallelRunner(*args, group=self.group, workers=self.workers, **kwargs)

    def adapter_slots(self, settings, config, rank_config, device, dtype):
        """Rank 0's LoRA slots (``build_lora``'s ``slots``): its shard's, each write sent to the ranks."""
        from kvserve.parallel.lora_shards import ShardedAdapterSlots
        return ShardedAdapterSlots(config, rank_config, settings.max_loras, settings.max_lora_rank, device, dtype,
                                   self.group)

    def draft_runner(self, num_layers: int):
        """A factory (``ModelRunner``'s arguments) of rank 0's self-draft runner over the
        shard's first ``num_layers`` layers, driving the same layers on the other ranks."""
        return functools.partial(TensorParallelDraftRunner, group=self.group, num_layers=num_layers)

    def _terminate(self) -> None:
        for proc in self.workers:
            proc.terminate()
            proc.wait(10)

    def abort(self) -> None:
        """Stop the workers after a failed start."""
        self._terminate()
