"""Adapters by name, in three tiers: resident slots, host memory, disk.

``LoRAManager`` is both the engine's ``AdapterCatalog`` (names -> identities, load,
unload, describe, counters) and the scheduler's ``ResidencyGate``:

- A name resolves to the identity (content digest) of what is loaded under it now; a
  request keeps that identity even if the name is reloaded while it waits or runs.
- Host tier: up to ``max_host`` adapters' weights in host memory, least recently used
  dropped first. Weights a queued or running sequence needs are never dropped (the
  tier may then hold more until they end); a dropped adapter whose name still
  resolves is read from disk again on its next request, and must digest the same.
- Resident tier: ``AdapterSlots``. A sequence is admitted only once its adapter is in
  a slot; slots pinned by running sequences are never replaced. When no slot is free,
  the least recently used pinned slot is reserved for the waiting adapter: no new
  sequence pins it, so it frees as its sequences finish and the waiting adapter gets
  it (no adapter waits forever behind busy ones).
"""
from __future__ import annotations

import logging
import time
from collections import OrderedDict
from dataclasses import dataclass

from kvserve.config import ModelConfig
from kvserve.engine.stats import AdapterCounters
from kvserve.errors import AdapterLoadError, AdapterNotFoundError
from kvserve.lora.peft_format import AdapterWeights, load_peft_adapter
from kvserve.lora.slots import AdapterSlots

logger = logging.getLogger("kvserve.lora")


@dataclass
class AdapterRecord:
    """A name that resolves: where it was loaded from and what it is."""

    name: str
    path: str
    key: str                       # content digest: cache namespace and residency key
    rank: int
    lora_alpha: float
    target_modules: list[str]
    loaded_at: float


class LoRAManager:
    """Catalog of adapters and gate of the scheduler (see the module docstring)."""

    def __init__(self, model_config: ModelConfig, slots: AdapterSlots, max_host: int, clock=time.monotonic):
        self.model_config, self.slots, self.max_host = model_config, slots, max(max_host, slots.num_slots)
        self.clock = clock
        self._names: dict[str, AdapterRecord] = {}
        self._host: OrderedDict[str, AdapterWeights] = OrderedDict()     # key -> weights, LRU first
        self._slot_key: list[str | None] = [None] * slots.num_slots
        self._slot_of: dict[str, int] = {}
        self._pins = [0] * slots.num_slots
        self._last_used = [0.0] * slots.num_slots
        self._reserved: dict[int, str] = {}          # slot -> key waiting for it
        self._seq_key: dict[int, str] = {}           # live sequences with an adapter
        self._seq_slot: dict[int, int] = {}          # of those, running (pinned)
        self._held_back: dict[int, str] = {}         # refused by acquire, still waiting
        self._live: dict[str, int] = {}              # key -> live sequences
        self._counts = {"disk_loads": 0, "slot_loads": 0, "slot_evictions": 0, "host_evictions": 0}
        self._seconds = {"disk": 0.0, "slot": 0.0}

    # ---------------------------------------------------------------- catalog
    def load(self, name: str, path: str) -> dict:
        if not name or not isinstance(name, str):
            raise AdapterLoadError("an adapter needs a non-empty name", param="lora_name")
        if name in self._names:
            raise AdapterLoadError(f"an adapter named {name!r} is already loaded; unload it first",
                                   param="lora_name")
        weights = self._read(path)
        key = weights.digest
        self._names[name] = AdapterRecord(name, weights.path, key, weights.rank, weights.lora_alpha,
                                          weights.target_modules, time.time())
        self._host_put(key, weights)
        logger.info("LoRA adapter %r loaded from %s: rank %d, alpha %g, modules %s, %.1f MB, id %s", name,
                    weights.path, weights.rank, weights.lora_alpha, ",".join(weights.target_modules),
                    weights.nbytes / 1e6, key[:12])
        return self._describe(self._names[name])

    def unload(self, name: str) -> None:
        if self._names.pop(name, None) is None:
            raise AdapterNotFoundError(f"no adapter named {name!r} is loaded", param="lora_name")
        self._trim_host()

    def resolve(self, name: str) -> str:
        record = self._names.get(name)
        if record is None:
            raise AdapterNotFoundError(f"the model {name!r} does not exist (no adapter of that name is loaded)",
                                       param="model")
        if record.key not in self._host:           # dropped from host memory: read it again
            weights = self._read(record.path)
            if weights.digest != record.key:
                raise AdapterLoadError(f"the files of adapter {name!r} at {record.path} changed since it was "
                                       "loaded; load it again under a name", param="model")
            self._host_put(record.key, weights)
        self._host.move_to_end(record.key)
        return record.key

    def describe(self) -> list[dict]:
        return [self._describe(r) for r in self._names.values()]

    def _describe(self, record: AdapterRecord) -> dict:
        tier = "resident" if record.key in self._slot_of else "host" if record.key in self._host else "disk"
        return {"name": record.name, "path": record.path, "id": record.key, "rank": record.rank,
                "lora_alpha": record.lora_alpha, "target_modules": record.target_modules, "tier": tier,
                "created": int(record.loaded_at)}

    def counters(self) -> AdapterCounters:
        names: dict[str, list[str]] = {}
        for record in self._names.values():
            names.setdefault(record.key, []).append(record.name)
        running = {n for key in (self._slot_key[s] for s in set(self._seq_slot.values())) for n in names.get(key, [])}
        waiting = {n for key in self._held_back.values() for n in names.get(key, [])}
        c = self._counts
        return AdapterCounters(
            enabled=True, max_resident=self.slots.num_slots, max_host=self.max_host,
            num_registered=len(self._names), num_resident=len(self._slot_of), num_host=len(self._host),
            num_disk_loads=c["disk_loads"], num_slot_loads=c["slot_loads"],
            num_slot_evictions=c["slot_evictions"], num_host_evictions=c["host_evictions"],
            disk_load_seconds=self._seconds["disk"], slot_load_seconds=self._seconds["slot"],
            num_waiting_for_slot=len(self._held_back), running_adapters=sorted(running),
            waiting_adapters=sorted(waiting), resident_ids=sorted(self._slot_of))

    def slot_of(self, key: str) -> int:
        """The resident slot of ``key`` (the batch context's lookup; it is resident while
        a sequence that uses it runs)."""
        return self._slot_of[key]

    # ------------------------------------------------------------ host tier
    def _read(self, path: str) -> AdapterWeights:
        started = time.perf_counter()
        weights = load_peft_adapter(path, self.model_config, self.slots.max_rank)
        self._seconds["disk"] += time.perf_counter() - started
        self._counts["disk_loads"] += 1
        return weights

    def _host_put(self, key: str, weights: AdapterWeights) -> None:
        self._host[key] = weights
        self._host.move_to_end(key)
        self._trim_host(keep=key)

    def _trim_host(self, keep: str | None = None) -> None:
        """Drop least recently used weights no live sequence needs: unregistered ones
        always, the rest down to ``max_host``. ``keep`` (just read for a request that
        is about to register) is never dropped."""
        registered = {r.key for r in self._names.values()}
        for key in list(self._host):
            if self._live.get(key, 0) or key == keep:
                continue
            if key not in registered or len(self._host) > self.max_host:
                del self._host[key]
                self._counts["host_evictions"] += 1

    # ------------------------------------------------------------------ gate
    def register(self, seq_id: int, adapter_key: str | None) -> None:
        if adapter_key is not None:
            self._seq_key[seq_id] = adapter_key
            self._live[adapter_key] = self._live.get(adapter_key, 0) + 1

    def acquire(self, seq_id: int) -> bool:
        key = self._seq_key.get(seq_id)
        if key is None or seq_id in self._seq_slot:
            return True
        slot = self._slot_of.get(key)
        if slot is None:
            slot = self._free_slot(key)
            if slot is not None:
                self._swap_in(slot, key)
        if slot is None or self._reserved.get(slot, key) != key:
            self._held_back[seq_id] = key
            if slot is None:
                self._reserve_for(key)
            return False
        self._unreserve(key)
        self._pins[slot] += 1
        self._seq_slot[seq_id] = slot
        self._held_back.pop(seq_id, None)
        return True

    def share(self, seq_id: int, leader_id: int) -> None:
        slot = self._seq_slot.get(leader_id)
        if slot is not None and seq_id not in self._seq_slot:
            self._pins[slot] += 1
            self._seq_slot[seq_id] = slot

    def release(self, seq_id: int) -> None:
        slot = self._seq_slot.pop(seq_id, None)
        if slot is not None:
            self._pins[slot] -= 1
            self._last_used[slot] = self.clock()

    def forget(self, seq_id: int) -> None:
        self.release(seq_id)
        held = self._held_back.pop(seq_id, None)
        if held is not None and held not in self._held_back.values():
            self._unreserve(held)          # nobody waits for it any more
        key = self._seq_key.pop(seq_id, None)
        if key is not None:
            self._live[key] -= 1
            if not self._live[key]:
                del self._live[key]
                self._trim_host()

    def _free_slot(self, key: str) -> int | None:
        """An unpinned slot ``key`` may take: one reserved for it, an empty one, else
        the least recently used unreserved one."""
        free = [s for s in range(self.slots.num_slots) if self._pins[s] == 0
                and self._reserved.get(s, key) == key]
        if not free:
            return None
        return min(free, key=lambda s: (self._reserved.get(s) != key, self._slot_key[s] is not None,
                                        self._last_used[s]))

    def _reserve_for(self, key: str) -> None:
        if key in self._reserved.values():
            return
        candidates = [s for s in range(self.slots.num_slots) if s not in self._reserved]
        if candidates:
            self._reserved[min(candidates, key=lambda s: self._last_used[s])] = key

    def _unreserve(self, key: str) -> None:
        for slot in [s for s, k in self._reserved.items() if k == key]:
            del self._reserved[slot]

    def _swap_in(self, slot: int, key: str) -> None:
        weights = self._host.get(key)
        if weights is None:        # a live key is never dropped from host memory
            raise AssertionError(f"adapter {key} is needed but not in host memory")
        started = time.perf_counter()
        old = self._slot_key[slot]
        if old is not None:
            del self._slot_of[old]
            self._counts["slot_evictions"] += 1
        self.slots.write(slot, weights)
        self._slot_key[slot], self._slot_of[key] = key, slot
        self._last_used[slot] = self.clock()
        self._host.move_to_end(key)
        self._counts["slot_loads"] += 1
        self._seconds["slot"] += time.perf_counter() - started
