"""Bucketing rules of the decode-graph path (kvserve.engine.cuda_graphs)."""
from __future__ import annotations

from kvserve.engine.cuda_graphs import MIN_CONTEXT_BLOCKS, batch_bucket, context_bucket


def test_batch_buckets_cover_every_size_with_bounded_padding():
    for max_num_seqs in (1, 7, 64, 256):
        for n in range(1, max_num_seqs + 1):
            bucket = batch_bucket(n, max_num_seqs)
            assert n <= bucket <= max_num_seqs
            assert bucket - n < max(n, 32), (n, bucket)       # at most doubles (small) or +31 rows
    assert [batch_bucket(n, 256) for n in (1, 2, 3, 5, 9, 63, 65, 200)] == [1, 2, 4, 8, 16, 64, 96, 224]
    assert len({batch_bucket(n, 256) for n in range(1, 257)}) == 4 + 7 + 6      # graphs there can be


def test_context_buckets_are_powers_of_two_within_the_table():
    assert context_bucket(1, 512) == MIN_CONTEXT_BLOCKS
    assert [context_bucket(n, 512) for n in (5, 8, 9, 300)] == [8, 8, 16, 512]
    assert context_bucket(100, 100) == 100                 # never past the widest table
    for n in range(1, 129):
        assert n <= context_bucket(n, 128) < max(2 * n, MIN_CONTEXT_BLOCKS + 1)
