"""Tier 1: the shared-memory KVTransfer (staging slots in /dev/shm), its slot
accounting, and the KV block copies in and out of a cache tensor. No model."""
import multiprocessing as mp
import os

import pytest
import torch

from kvserve.disagg.transfer import KVLayout, SharedMemoryTransfer, SlotAllocator, TransferTicket, attach_transfer
from kvserve.engine.kv.tensors import read_kv_blocks, write_kv_blocks

LAYOUT = KVLayout(num_layers=3, block_size=4, num_kv_heads=2, head_dim=8)


def blocks(n: int, seed: int) -> torch.Tensor:
    """KV of ``n`` blocks: [layers, 2, n, block_size, KVH, D]."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(LAYOUT.num_layers, 2, n, LAYOUT.block_size, LAYOUT.num_kv_heads, LAYOUT.head_dim, generator=g)


def test_slot_allocator_accounting():
    slots = SlotAllocator(5)
    a = slots.take("a", 3)
    assert slots.take("b", 3) is None and slots.num_free == 2
    with pytest.raises(RuntimeError):
        slots.take("a", 1)
    slots.give("a")
    with pytest.raises(RuntimeError):
        slots.give("a")
    assert slots.take("b", 5) is not None and len(a) == 3
    slots.check_integrity()


def test_send_receive_in_the_same_mapping_and_another():
    transfer = SharedMemoryTransfer(LAYOUT, num_slots=8)
    try:
        other = attach_transfer(transfer.describe())
        ticket = transfer.reserve("t0", 3)
        kv, hashes = blocks(3, 0), [11, 2**62 + 5, 7]
        transfer.send(ticket, hashes, kv)
        got_hashes, got = other.receive(ticket, 3)
        assert got_hashes == hashes and torch.equal(got, kv)
        two_hashes, two = other.receive(ticket, 2)
        assert two_hashes == hashes[:2] and torch.equal(two, kv[:, :, :2])
        with pytest.raises(ValueError):
            transfer.send(ticket, [1, 2, 3, 4], blocks(4, 1))        # more than the ticket holds
        with pytest.raises(RuntimeError):
            other.reserve("t1", 1)                                    # only the creator reserves
        transfer.release(ticket)
        transfer.check_integrity()
        assert transfer.num_free_blocks == 8
        other.close()
        assert os.path.exists(transfer.path)                          # an attached process only unmaps
    finally:
        transfer.close()
    assert not os.path.exists(transfer.path)


def _child_send(description: dict, slots: tuple, seed: int) -> None:
    transfer = attach_transfer(description)
    transfer.send(TransferTicket("t", slots), [seed, seed + 1], blocks(2, seed))
    transfer.close()


def test_another_process_writes_what_this_one_reads():
    transfer = SharedMemoryTransfer(LAYOUT, num_slots=4)
    try:
        ticket = transfer.reserve("t", 2)
        child = mp.get_context("spawn").Process(target=_child_send, args=(transfer.describe(), ticket.slots, 5))
        child.start()
        child.join(60)
        assert child.exitcode == 0
        hashes, kv = transfer.receive(ticket, 2)
        assert hashes == [5, 6] and torch.equal(kv, blocks(2, 5))
    finally:
        transfer.close()


def test_read_and_write_kv_blocks_of_a_cache():
    cache = torch.zeros(LAYOUT.num_layers, 2, 10, LAYOUT.block_size, LAYOUT.num_kv_heads, LAYOUT.head_dim)
    kv = blocks(3, 3)
    write_kv_blocks(cache, [7, 2, 5], kv)
    assert torch.equal(cache[:, :, 2], kv[:, :, 1]) and torch.equal(cache[:, :, 0], torch.zeros_like(cache[:, :, 0]))
    assert torch.equal(read_kv_blocks(cache, [7, 2, 5]), kv)
    with pytest.raises(ValueError):
        write_kv_blocks(cache, [1, 2], kv)


def test_block_bytes_arithmetic():
    # 2 (K and V) x 3 layers x 4 tokens x 2 kv heads x 8 dims x 4 B
    assert LAYOUT.block_bytes == 2 * 3 * 4 * 2 * 8 * 4


def test_mappings_outlive_the_unlinked_file():
    transfer = SharedMemoryTransfer(LAYOUT, num_slots=2)
    other = attach_transfer(transfer.describe())
    transfer.unlink()
    assert not os.path.exists(transfer.path)
    ticket = transfer.reserve("t", 2)
    transfer.send(ticket, [3, 4], blocks(2, 9))
    hashes, kv = other.receive(ticket, 2)
    assert hashes == [3, 4] and torch.equal(kv, blocks(2, 9))
    transfer.close()
