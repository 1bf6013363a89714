"""Row-parallel shards of a quantised projection hold the whole weight's codes and scales."""
from __future__ import annotations

import pytest
import torch

from kvserve.models.projection import Projection
from kvserve.parallel.tensor_parallel import _row_parallel
from kvserve.quant.formats import Int4Weight, as_format


@pytest.mark.parametrize("scheme", ["int8", "int4"])
def test_row_parallel_shards_cut_the_whole_weights_quantisation(scheme):
    proj = Projection(48, 256)
    weight = torch.randn(48, 256, generator=torch.Generator().manual_seed(0))
    weight[:, 200] *= 40                      # an outlier input channel, in the second shard only
    proj.weight = torch.nn.Parameter(weight, requires_grad=False)
    whole = as_format(weight, scheme)
    for lo, hi in ((0, 128), (128, 256)):
        shard = _row_parallel(proj, lo, hi, group=None, quantization=scheme).quantized_weight
        assert torch.equal(shard.codes, whole.codes[:, lo:hi])
        assert torch.equal(shard.dequantize(), whole.dequantize()[:, lo:hi])
    # the first shard, quantised on its own, would get finer per-channel scales: not TP=1's codes
    if scheme == "int8":
        assert not torch.equal(as_format(weight[:, :128], scheme).codes, whole.codes[:, :128])


def test_int4_shards_must_fall_on_group_boundaries():
    whole = as_format(torch.randn(8, 128), "int4")
    assert isinstance(whole, Int4Weight) and whole.group_size == 32
    with pytest.raises(ValueError, match="cannot be split"):
        whole.cols(0, 48)
