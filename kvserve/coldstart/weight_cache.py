"""A host-memory weight cache: the cold start's second layer (storage -> host -> unpack) skipped.

A checkpoint, once read and unpacked (GGUF blocks dequantised, names mapped to Hugging Face's,
shapes checked), is written as one safetensors file plus its ``ModelConfig`` into a folder
on a memory filesystem (``/dev/shm`` by default: tmpfs, so "on disk" there is host memory).
The next replica of that checkpoint reads the flat file instead of parsing and dequantising
the original: a memory copy at memory bandwidth.

Entries are keyed by the source's absolute path, size and modification time and the GGUF
block types kept quantised (a changed file is a new entry). The cache holds at most
``max_bytes``; the least recently used entries are evicted first. Checkpoints whose tensors
are kept quantised (``direct_types``) are not cached (their blocks are not plain tensors).
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import shutil
import time

from kvserve.config import ModelConfig, MoEConfig
from kvserve.loader.checkpoint import Checkpoint

logger = logging.getLogger("kvserve.coldstart")

DEFAULT_ROOT = "/dev/shm/kvserve-weights"
FORMAT_VERSION = 1


def _config_from_dict(raw: dict) -> ModelConfig:
    fields = dict(raw)
    fields["eos_token_ids"] = tuple(fields.get("eos_token_ids", ()))
    if fields.get("moe") is not None:
        moe = dict(fields["moe"])
        moe["mlp_only_layers"] = tuple(moe.get("mlp_only_layers", ()))
        fields["moe"] = MoEConfig(**moe)
    return ModelConfig(**fields)


class HostWeightCache:
    """Unpacked checkpoints in a host-memory folder, at most ``max_bytes`` of them."""

    def __init__(self, root: str = DEFAULT_ROOT, max_bytes: int = 8 * 2**30):
        self.root, self.max_bytes = root, max_bytes

    def key(self, path: str, direct_types: tuple[str, ...] = ()) -> str:
        """The entry name for the checkpoint at ``path`` as it is now."""
        path = os.path.abspath(path)
        stat = os.stat(path)
        size = stat.st_size if os.path.isfile(path) else sum(
            os.path.getsize(os.path.join(path, f)) for f in sorted(os.listdir(path)))
        text = json.dumps([FORMAT_VERSION, path, size, stat.st_mtime_ns, list(direct_types)])
        return hashlib.sha256(text.encode()).hexdigest()[:24]

    def get(self, path: str, direct_types: tuple[str, ...] = ()) -> Checkpoint | None:
        """The cached checkpoint for ``path``, or None (a miss)."""
        from safetensors.torch import load_file
        folder = os.path.join(self.root, self.key(path, direct_types))
        if not os.path.exists(os.path.join(folder, "meta.json")):
            return None
        with open(os.path.join(folder, "meta.json")) as f:
            meta = json.load(f)
        tensors = load_file(os.path.join(folder, "weights.safetensors"))
        os.utime(folder)                                   # recently used: evicted last
        return Checkpoint(_config_from_dict(meta["config"]), tensors, meta["path"], meta["kind"])

    def put(self, checkpoint: Checkpoint, direct_types: tuple[str, ...] = ()) -> bool:
        """Store ``checkpoint`` (before its tensors are consumed); False when it cannot be
        cached (quantised blocks, or larger than the whole cache)."""
        import torch
        from safetensors.torch import save_file
        tensors = checkpoint.tensors
        if not all(isinstance(t, torch.Tensor) for t in tensors.values()):
            return False
        size = sum(t.numel() * t.element_size() for t in tensors.values())
        if size > self.max_bytes:
            return False
        self._evict_for(size)
        folder = os.path.join(self.root, self.key(checkpoint.path, direct_types))
        staging = f"{folder}.tmp-{os.getpid()}"
        os.makedirs(staging, exist_ok=True)
        save_file({k: t.contiguous() for k, t in tensors.items()}, os.path.join(staging, "weights.safetensors"))
        meta = {"config": dataclasses.asdict(checkpoint.config), "path": checkpoint.path, "kind": checkpoint.kind,
                "bytes": size, "stored_at": time.time()}
        with open(os.path.join(staging, "meta.json"), "w") as f:
            json.dump(meta, f)
        shutil.rmtree(folder, ignore_errors=True)
        os.replace(staging, folder)                       # readers see a whole entry or none
        return True

    def entries(self) -> list[tuple[str, int, float]]:
        """(entry, bytes, last used) of every entry, least recently used first."""
        if not os.path.isdir(self.root):
            return []
        out = []
        for name in os.listdir(self.root):
            folder = os.path.join(self.root, name)
            weights = os.path.join(folder, "weights.safetensors")
            if ".tmp-" not in name and os.path.exists(weights):
                out.append((name, os.path.getsize(weights), os.path.getmtime(folder)))
        return sorted(out, key=lambda e: e[2])

    def _evict_for(self, incoming: int) -> None:
        entries = self.entries()
        used = sum(e[1] for e in entries)
        for name, size, _ in entries:
            if used + incoming <= self.max_bytes:
                break
            shutil.rmtree(os.path.join(self.root, name), ignore_errors=True)
            used -= size
            logger.info("host weight cache: evicted %s (%d bytes)", name, size)


def load_cached_checkpoint(model: str | None, direct_types: tuple[str, ...], cache: HostWeightCache
                           ) -> tuple[Checkpoint, bool]:
    """(checkpoint, whether it came from the cache): read from ``cache`` when it holds
    ``model``, else load it the normal way and store it there for the next replica."""
    from kvserve.loader import load_checkpoint
    from kvserve.loader.api import resolve_model_path
    path = resolve_model_path(model)
    cached = cache.get(path, direct_types)
    if cached is not None:
        return cached, True
    checkpoint = load_checkpoint(path, direct_types)
    if not cache.put(checkpoint, direct_types):
        logger.info("host weight cache: %s not cached (quantised blocks or over %d bytes)", path, cache.max_bytes)
    return checkpoint, False
