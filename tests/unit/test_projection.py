"""Projection layouts: every layout computes the checkpoint's ``x @ W.T + b``."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kvserve.models.projection import Projection


def _projection(out_features: int, in_features: int, bias: bool) -> tuple[Projection, torch.Tensor, torch.Tensor]:
    proj = Projection(out_features, in_features, bias=bias)
    weight, b = torch.randn(out_features, in_features), torch.randn(out_features)
    proj.weight.data = weight.clone()
    if bias:
        proj.bias.data = b.clone()
    return proj, weight, (b if bias else None)


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("onednn", [False, True, None])
def test_packed_layouts_compute_the_same_map(bias, onednn):
    torch.manual_seed(0)
    proj, weight, b = _projection(96, 40, bias)                # wide: the default picks oneDNN
    layout = proj.pack(onednn=onednn)
    assert layout == ("onednn" if onednn is not False and torch.backends.mkldnn.is_available() else "in_out")
    assert proj.pack() == layout                                     # packing twice is a no-op
    for rows in (1, 3, 16, 70):
        x = torch.randn(rows, 40)
        expected = F.linear(x.double(), weight.double(), None if b is None else b.double())
        assert torch.allclose(proj(x).double(), expected, atol=1e-4, rtol=1e-4)
        out = torch.randn(rows, 96)
        start = out.clone()
        proj.accumulate_(out, x)
        assert torch.allclose(out.double(), start.double() + expected, atol=1e-4, rtol=1e-4)


def test_in_out_layout_takes_row_strided_inputs_and_replaces_the_weight():
    torch.manual_seed(1)
    proj, weight, _ = _projection(24, 32, False)
    assert proj.pack() == "in_out"                          # narrow: [in, out] by default
    assert proj.weight.shape == (32, 24) and proj.weight.is_contiguous()
    wide = torch.randn(5, 64)
    x = wide[:, :32]                                     # a row-strided view, as the MLP's gate half
    assert torch.allclose(proj(x), F.linear(x, weight), atol=1e-5)


def test_onednn_head_rows_do_not_depend_on_batch_size():
    torch.manual_seed(2)
    proj, _, _ = _projection(512, 64, False)
    if proj.pack(onednn=True) != "onednn":
        pytest.skip("this torch build has no oneDNN linear")
    x = torch.randn(33, 64)
    alone = proj(x[:1])
    for rows in (2, 8, 16, 33):
        assert torch.equal(proj(x[:rows])[:1], alone)


def test_half_precision_keeps_the_checkpoint_layout():
    proj, weight, _ = _projection(8, 4, False)
    proj.to(torch.bfloat16)
    assert proj.pack(onednn=True) == "out_in"
    assert proj.weight.shape == weight.shape


def test_onednn_products_run_on_a_bounded_set_of_row_counts(monkeypatch):
    """oneDNN caches a primitive per shape: a product's row counts come from at most
    ONEDNN_ROW_CHUNK + T / ONEDNN_ROW_CHUNK values, and the split changes no bit."""
    from kvserve.models import projection as module
    torch.manual_seed(3)
    proj, _, _ = _projection(256, 32, True)
    if proj.pack(onednn=True) != "onednn":
        pytest.skip("this torch build has no oneDNN linear")
    chunk = module.ONEDNN_ROW_CHUNK
    x = torch.randn(5 * chunk + 7, 32)
    unsplit = torch.ops.mkldnn._linear_pointwise(x, proj._onednn_weight, proj.bias, "none", [], "")
    assert torch.equal(proj(x), unsplit)
    seen: set[int] = set()
    real = torch.ops.mkldnn._linear_pointwise

    class Recorder:
        @staticmethod
        def _linear_pointwise(inp, *args):
            seen.add(inp.shape[0])
            return real(inp, *args)

    monkeypatch.setattr(module.torch.ops, "mkldnn", Recorder)
    for rows in range(1, 4 * chunk + 1):
        assert proj(x[:rows]).shape == (rows, 256)
    assert seen == set(range(1, chunk)) | {chunk * k for k in range(1, 5)}
