"""Tier 1: the block pool (no model, no torch)."""
import pytest

from kvserve.engine.kv.block_pool import BlockPool


def test_allocate_free_roundtrip():
    pool = BlockPool(8, 16)
    a = pool.allocate(3)
    b = pool.allocate(5)
    assert sorted(a + b) == list(range(8))
    assert pool.allocate(1) is None                 # "cannot allocate" is a value, not an exception
    assert pool.num_free_blocks == 0 and pool.num_used_blocks == 8
    pool.check_integrity([a, b])
    pool.free(a)
    assert pool.num_free_blocks == 3
    pool.check_integrity([b])
    pool.free(b)
    pool.check_integrity([])


def test_sharing_counts_references():
    pool = BlockPool(4, 16)
    a = pool.allocate(2)
    pool.share(a)
    assert [pool.ref_count(x) for x in a] == [2, 2]
    pool.check_integrity([a, list(a)])
    pool.free(a)
    assert pool.num_free_blocks == 2                # still held once
    pool.free(a)
    assert pool.num_free_blocks == 4
    pool.check_integrity([])


def test_broken_invariants_raise():
    pool = BlockPool(2, 16)
    a = pool.allocate(1)
    pool.free(a)
    with pytest.raises(RuntimeError):
        pool.free(a)
    with pytest.raises(RuntimeError):
        pool.share(a)
    b = pool.allocate(1)
    with pytest.raises(AssertionError):
        pool.check_integrity([])                    # b is leaked: held by no table
    pool.free(b)


def test_blocks_for_tokens():
    pool = BlockPool(2, 16)
    assert [pool.blocks_for_tokens(n) for n in (0, 1, 16, 17, 32)] == [0, 1, 1, 2, 2]
