"""Weights swapped in place, and sleep / wake: the warm tier's fast path and the RL rollout
case (docs/coldstart.md), without a process restart.

- ``load_weights(engine, path)``: a checkpoint of the same shape (architecture, layers, heads,
  widths, vocabulary) replaces the model between steps; the engine's weight epoch is bumped,
  so no prefix-cache block computed with the old weights is ever matched again (DESIGN.md §3's
  namespace). It runs only on an idle engine — a front end stops admitting and lets in-flight
  requests finish on the old weights first — so no request ever mixes two sets of weights.
- ``sleep(engine)``: frees the KV cache (the prefix cache is emptied: its blocks' contents go)
  and, on a GPU, moves the weights to host memory. ``wake(engine)``: brings the weights back
  and allocates a zeroed KV cache of the same plan. Greedy outputs after wake equal those
  before sleep. A sleeping engine refuses requests.
"""
from __future__ import annotations

import dataclasses
import logging
import time

from kvserve.errors import EngineBusyError, InvalidRequestError

logger = logging.getLogger("kvserve.engine")

# ModelConfig fields that shape the weights and the KV cache: equal, or no swap in place
SHAPE_FIELDS = ("architecture", "vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                "num_kv_heads", "head_dim", "tie_word_embeddings", "attention_bias", "moe")


@dataclasses.dataclass
class Asleep:
    """What ``wake`` needs: where the weights were, and that the KV cache is gone."""

    device: object                   # torch.device the weights and KV cache live on
    dtype: object                    # torch dtype of computation (the KV cache is recreated in it)
    weights_moved: bool


def _require_idle(engine, action: str) -> None:
    if engine.asleep is not None:
        raise EngineBusyError(f"cannot {action}: the engine is asleep (wake it first)")
    if engine.has_unfinished():
        raise EngineBusyError(f"cannot {action} while requests are in flight: stop admitting and let them "
                              "finish first")


def _check_swappable(engine) -> None:
    runner = engine.runner
    if type(runner).__name__ != "ModelRunner":
        raise InvalidRequestError(f"weights cannot be swapped in place on a {type(runner).__name__} "
                                  "(tensor-parallel ranks): restart the replica", param="model")
    if engine.adapters is not None:
        raise InvalidRequestError("weights cannot be swapped in place with LoRA adapters loaded (their "
                                  "slots are shaped and packed for the old model)", param="model")


def load_weights(engine, model_path: str) -> dict:
    """Swap in the checkpoint at ``model_path``; returns the new epoch and the seconds it took."""
    from kvserve.engine.model_loading import load_model
    from kvserve.engine.startup_gc import refreeze_after_release
    from kvserve.loader import load_checkpoint
    _require_idle(engine, "load weights")
    _check_swappable(engine)
    started = time.perf_counter()
    checkpoint = load_checkpoint(model_path)
    old, new = engine.model_config, checkpoint.config
    differ = [f for f in SHAPE_FIELDS if getattr(old, f) != getattr(new, f)]
    if differ:
        raise InvalidRequestError(f"{model_path} is shaped differently ({', '.join(differ)}): a swap in place "
                                  "needs the same architecture; restart the replica on it", param="model")
    device, dtype = engine.runner.device, engine.dtype
    engine.runner.model = load_model(checkpoint, device, dtype, engine.config.quantization)
    refreeze_after_release()                       # the old model's cycles, frozen at start-up
    epoch = engine.bump_weight_epoch()
    seconds = time.perf_counter() - started
    logger.info("weights loaded in place from %s in %.2f s: weight epoch %d", model_path, seconds, epoch)
    return {"model": model_path, "weight_epoch": epoch, "seconds": round(seconds, 3)}


def sleep(engine) -> dict:
    """Free the KV cache (and move GPU weights to host memory); returns what was freed."""
    _require_idle(engine, "sleep")
    runner, dtype = engine.runner, engine.dtype
    freed = int(engine.kv_plan.bytes_per_block * engine.kv_plan.num_blocks)
    engine.kv.reset_prefix_cache()                # the cached blocks' contents are about to go
    runner.kv_cache = None
    moved = runner.device.type != "cpu"
    if moved:
        import torch
        runner.model.to("cpu")
        torch.cuda.empty_cache()
    engine.asleep = Asleep(runner.device, dtype, moved)
    logger.info("asleep: KV cache freed (%d bytes)%s", freed, ", weights in host memory" if moved else "")
    return {"kv_bytes_freed": freed, "weights_to_host": moved}


def wake(engine) -> dict:
    """Undo ``sleep``: weights back on their device, a zeroed KV cache of the same plan."""
    from kvserve.engine.kv.tensors import allocate_kv_cache
    if engine.asleep is None:
        raise EngineBusyError("cannot wake: the engine is not asleep")
    runner, asleep = engine.runner, engine.asleep
    started = time.perf_counter()
    if asleep.weights_moved:
        runner.model.to(asleep.device)
    runner.kv_cache = allocate_kv_cache(engine.model_config, engine.kv_plan, engine.config.kv_cache_dtype,
                                        asleep.device, asleep.dtype)
    engine.asleep = None
    return {"seconds": round(time.perf_counter() - started, 3)}
