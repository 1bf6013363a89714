"""Tier 1: LoRAManager (kvserve/lora/manager.py) on small CPU slots and hand-written
adapters: pins, LRU slot replacement, reservations, the host tier, unload, reload
from disk; then the scheduler with the manager as its residency gate."""
from __future__ import annotations

import pytest
import torch

from kvserve.errors import AdapterLoadError, AdapterNotFoundError
from kvserve.lora.manager import LoRAManager
from kvserve.lora.slots import AdapterSlots
from tests.support.lora_adapters import synthetic_adapter, tiny_model_config
from tests.support.scheduler_harness import SchedulerHarness

MC = tiny_model_config()


class Clock:
    now = 0.0

    def __call__(self) -> float:
        self.now += 1.0          # every reading is later than the last
        return self.now


def make_manager(tmp_path, names="abcdef", num_slots=2, max_host=2) -> tuple[LoRAManager, dict]:
    """A manager with adapters ``names`` loaded; returns it and name -> key."""
    m = LoRAManager(MC, AdapterSlots(MC, num_slots, 4, "cpu", torch.float32), max_host, clock=Clock())
    keys = {}
    for seed, name in enumerate(names):
        keys[name] = m.load(name, synthetic_adapter(tmp_path / name, MC, seed=seed))["id"]
    return m, keys


def pins(m: LoRAManager) -> dict:
    """Resident key -> pin count."""
    return {key: m._pins[slot] for slot, key in enumerate(m._slot_key) if key is not None}


def start(m: LoRAManager, seq_id: int, name: str) -> bool:
    """What the engine and the scheduler do for a new sequence: resolve, register, acquire."""
    m.register(seq_id, m.resolve(name))
    return m.acquire(seq_id)


# ---------------------------------------------------------------- pins and LRU
def test_pins_follow_acquire_release_forget(tmp_path):
    m, k = make_manager(tmp_path, "ab")
    assert start(m, 1, "a") and start(m, 2, "a") and start(m, 3, "b")
    assert pins(m) == {k["a"]: 2, k["b"]: 1}
    assert m.acquire(1) and pins(m)[k["a"]] == 2           # a running sequence: no second pin
    m.release(1)
    m.release(1)                                           # no-op: nothing pinned
    assert pins(m)[k["a"]] == 1
    m.forget(2)
    m.forget(2)                                            # idempotent
    m.forget(1)
    assert pins(m) == {k["a"]: 0, k["b"]: 1}
    m.register(4, None)
    assert m.acquire(4)                                    # the base weights need no slot
    c = m.counters()
    assert (c.num_resident, c.num_slot_loads, c.running_adapters) == (2, 2, ["b"])


def test_lru_replacement_never_evicts_a_pinned_slot(tmp_path):
    m, k = make_manager(tmp_path, "abcd", max_host=4)
    start(m, 1, "a")
    start(m, 2, "b")
    m.forget(1)                                            # a: free, least recently used
    m.forget(2)
    assert start(m, 3, "c") and set(pins(m)) == {k["b"], k["c"]}      # a was replaced
    start(m, 4, "b")                                       # b pinned, c free but more recent
    m.forget(3)
    assert start(m, 5, "d") and set(pins(m)) == {k["b"], k["d"]}      # c replaced, pinned b kept
    assert start(m, 6, "b") and m.counters().num_slot_evictions == 2
    assert m.counters().num_slot_loads == 4


def test_the_first_slot_an_adapter_takes_is_an_empty_one(tmp_path):
    m, k = make_manager(tmp_path, "abc", num_slots=3, max_host=3)
    start(m, 1, "a")
    m.forget(1)
    start(m, 2, "b")
    assert set(pins(m)) == {k["a"], k["b"]} and m.counters().num_slot_evictions == 0


# --------------------------------------------------------------- reservations
def test_a_waiting_adapter_reserves_a_busy_slot_and_gets_it(tmp_path):
    m, k = make_manager(tmp_path, "abc", max_host=3)
    assert start(m, 1, "a") and start(m, 2, "b")          # a swapped in first: least recently used
    assert not start(m, 3, "c")                            # no free slot: c reserves a's
    c = m.counters()
    assert (c.num_waiting_for_slot, c.waiting_adapters, c.running_adapters) == (1, ["c"], ["a", "b"])
    assert not start(m, 4, "a")                            # a's slot is promised: a new a waits
    assert start(m, 5, "b")                                # b's is not
    assert not m.acquire(3)                                # still pinned by sequence 1
    m.forget(1)
    assert m.acquire(3) and pins(m) == {k["c"]: 1, k["b"]: 2}
    assert not m.acquire(4)                                # a now waits in its turn (reserves b's)
    assert not start(m, 6, "b")
    m.forget(2)
    m.forget(5)
    assert m.acquire(4) and m.acquire(6) is False
    assert m.counters().num_waiting_for_slot == 1          # only sequence 6 (b) still waits


def test_an_abandoned_reservation_is_dropped(tmp_path):
    m, _k = make_manager(tmp_path, "abc", max_host=3)
    start(m, 1, "a")
    start(m, 2, "b")
    assert not start(m, 3, "c") and not start(m, 4, "c")  # two sequences of c wait
    m.forget(3)
    assert not start(m, 5, "a")                            # 4 still waits: the slot stays promised
    m.forget(4)                                            # aborted: nobody waits for c
    assert m.acquire(5)                                    # a's resident slot is open again
    assert m.counters().num_waiting_for_slot == 0 and not m._reserved


def test_a_reserved_slot_is_taken_by_its_adapter_only(tmp_path):
    m, k = make_manager(tmp_path, "abcd", max_host=4)
    start(m, 1, "a")
    start(m, 2, "b")
    assert not start(m, 3, "c")                            # reserves a's slot
    m.forget(1)
    assert not start(m, 4, "d")                            # the free slot is c's: d waits
    assert m.acquire(3) and k["d"] not in pins(m)


# ------------------------------------------------------------------ host tier
def test_host_tier_keeps_the_most_recent_and_never_drops_live_weights(tmp_path):
    m, k = make_manager(tmp_path, "abc", max_host=2)
    assert [a["tier"] for a in m.describe()] == ["disk", "host", "host"]
    assert m.counters().num_host_evictions == 1
    m.register(1, m.resolve("a"))                          # read again: a is live now
    m.register(2, m.resolve("b"))
    m.register(3, m.resolve("c"))                          # three live adapters, two places
    assert set(m._host) == {k["a"], k["b"], k["c"]}
    for seq_id in (1, 2, 3):
        assert m.acquire(seq_id) is (seq_id != 3)          # 2 slots: c waits
    m.forget(1)
    assert m.acquire(3)                                    # c's weights were kept for it
    for seq_id in (2, 3):
        m.forget(seq_id)
    assert len(m._host) == 2 and m.counters().num_host == 2


def test_resolve_reads_a_dropped_adapter_again_and_refuses_changed_files(tmp_path):
    m, k = make_manager(tmp_path, "abc", max_host=2)
    loads = m.counters().num_disk_loads
    assert m.resolve("a") == k["a"] and m.counters().num_disk_loads == loads + 1
    assert m.resolve("a") == k["a"] and m.counters().num_disk_loads == loads + 1   # now in memory
    m.resolve("b")
    m.resolve("c")                                         # a dropped again
    synthetic_adapter(tmp_path / "a", MC, seed=99)         # other weights in a's folder
    with pytest.raises(AdapterLoadError) as info:
        m.resolve("a")
    assert "'a'" in info.value.message and "changed" in info.value.message


def test_unload_keeps_running_sequences_and_their_slot(tmp_path):
    m, k = make_manager(tmp_path, "abc", max_host=2)
    assert start(m, 1, "b") and start(m, 2, "c")
    m.unload("b")
    with pytest.raises(AdapterNotFoundError):
        m.resolve("b")
    with pytest.raises(AdapterNotFoundError):
        m.unload("b")
    assert k["b"] in m._host and m.slot_of(k["b"]) == 0    # still running on it
    assert not start(m, 3, "a")                            # both slots pinned
    m.forget(1)
    assert k["b"] not in m._host                           # unregistered and unused: dropped
    assert m.acquire(3) and set(pins(m)) == {k["a"], k["c"]}
    assert [a["name"] for a in m.describe()] == ["a", "c"]


def test_load_names_and_identity(tmp_path):
    m, k = make_manager(tmp_path, "a")
    with pytest.raises(AdapterLoadError, match="already loaded"):
        m.load("a", str(tmp_path / "a"))
    with pytest.raises(AdapterLoadError, match="non-empty name"):
        m.load("", str(tmp_path / "a"))
    twin = m.load("twin", str(tmp_path / "a"))             # same files, another name: same identity
    assert twin["id"] == k["a"] and twin["rank"] == 2 and twin["target_modules"] == ["q_proj", "v_proj"]
    start(m, 1, "a")
    assert start(m, 2, "twin") and pins(m) == {k["a"]: 2}
    assert [a["tier"] for a in m.describe()] == ["resident", "resident"]
    assert m.counters().num_registered == 2 and m.counters().running_adapters == ["a", "twin"]


def test_slot_holds_the_scaled_transposed_adapter(tmp_path):
    m, k = make_manager(tmp_path, "a")
    start(m, 1, "a")
    weights, slot = m._host[k["a"]], m.slot_of(k["a"])
    a, b = weights.tensors[(1, "v_proj")]
    r, v_offset = weights.rank, MC.num_heads * MC.head_dim + MC.num_kv_heads * MC.head_dim
    a_slot, b_slot = m.slots.layer("qkv", 1).views[slot]
    # q and v adapted, k not: side by side in the first 2 r columns, v second
    assert a_slot.shape[1] == b_slot.shape[0] == 2 * r == m.slots.width["qkv"][slot]
    assert torch.equal(a_slot[:, r:2 * r], a.t())
    assert torch.allclose(b_slot[r:2 * r, v_offset:], b.t() * weights.scaling)
    assert not b_slot[r:2 * r, :v_offset].any()            # v's rows write v's columns only
    assert m.slots.layer("o", 1).views[slot] is None and m.slots.width["o"][slot] == 0


# ------------------------------------------------------------ with a scheduler
def check_gate(h: SchedulerHarness, m: LoRAManager) -> None:
    """Every running sequence with an adapter pins its resident slot, and only those pin."""
    running = [s for s in h.sched._running if s.adapter_key is not None]
    for s in running:
        assert m._slot_key[m._seq_slot[s.seq_id]] == s.adapter_key
    assert sum(m._pins) == len(running) == len(m._seq_slot)


def test_scheduler_lets_resident_adapters_overtake_and_everyone_finishes(tmp_path):
    m, k = make_manager(tmp_path, "abc", max_host=3)
    h = SchedulerHarness(gate=m, budget=64, max_num_seqs=8)
    h.add("a0", 6, max_tokens=12, adapter_key=k["a"])
    h.add("b0", 6, max_tokens=6, adapter_key=k["b"])
    h.step()
    h.add("c0", 6, max_tokens=4, adapter_key=k["c"])      # no slot: waits (reserves a's)
    h.add("base", 6, max_tokens=4)                         # base weights: runs now
    h.add("b1", 6, max_tokens=4, adapter_key=k["b"])       # b resident and not promised: runs
    h.add("a1", 6, max_tokens=4, adapter_key=k["a"])       # a's slot is promised to c: waits
    plan, _ = h.step()
    assert {h.seq(s.seq_id).request_id for s in plan.scheduled} == {"a0", "b0", "base", "b1"}
    assert m.counters().waiting_adapters == ["a", "c"]
    started: dict[str, int] = {}
    while h.sched.has_unfinished():
        plan, _ = h.step()
        check_gate(h, m)
        for s in plan.scheduled:
            started.setdefault(h.seq(s.seq_id).request_id, len(h.plans))
    assert set(h.finished) == {(r, 0) for r in ("a0", "b0", "c0", "base", "b1", "a1")}
    assert started["c0"] <= started["a1"]                  # a1 never overtook the adapter it waits behind
    assert sum(m._pins) == 0 and not m._reserved and m.counters().num_waiting_for_slot == 0
    assert h.pool.num_free_blocks == h.pool.num_blocks


def test_scheduler_preemption_releases_the_slot(tmp_path):
    m, k = make_manager(tmp_path, "abcdef", max_host=6)
    h = SchedulerHarness(gate=m, num_blocks=12, block_size=4, budget=16, max_num_seqs=6)
    for i, name in enumerate("abcdef"):
        h.add(f"r{i}", 10, max_tokens=10, adapter_key=k[name] if i % 3 else None)
    for _ in range(400):
        if not h.sched.has_unfinished():
            break
        h.step()
        check_gate(h, m)
    assert len(h.finished) == 6 and h.sched.num_preemptions > 0
    assert m.counters().num_slot_evictions > 0 and sum(m._pins) == 0


def test_n_siblings_fork_while_their_slot_is_reserved(tmp_path):
    m, k = make_manager(tmp_path, "ab", num_slots=1)
    h = SchedulerHarness(gate=m, budget=4)
    h.add("lead", 12, max_tokens=3, n=2, adapter_key=k["a"])    # prefill: three 4-token chunks
    h.step()
    h.add("other", 4, max_tokens=2, adapter_key=k["b"])         # waits, reserves a's slot
    h.run()
    assert len(h.finished) == 3
