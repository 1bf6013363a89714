"""Tier 1: the 8-bit KV cache (``kvserve.engine.kv.quantized``) and its sizing.

- quantise -> dequantise against float64: int8 within scale / 2 per element; fp8 within
  its mantissa's relative rounding bound (2^-4 e4m3, 2^-3 e5m2) of the value, plus half
  the smallest subnormal step for tiny values (so within 2^-m of amax per (token, head));
- the backend's attention over a quantised cache equals float64 attention over the
  dequantised values (tight), and stays within a derived bound of float64 attention over
  the unquantised values (see :func:`_perturbation_bound`);
- indexing (layer planes, ``[:layers]``, block copy) and the bytes/token arithmetic.
"""
from __future__ import annotations

import math

import pytest
import torch

from kvserve.attention import get_backend
from kvserve.attention import torch_paged
from kvserve.engine.kv.quantized import KV_FORMATS, QuantizedKV
from kvserve.engine.kv.sizing import kv_bytes_per_token, kv_cache_plan, kv_storage
from kvserve.engine.kv.tensors import allocate_kv_tensors, cache_kv_dtype
from tests.unit.test_attention_kernels import BS, D, H, KVH, NUM_BLOCKS, _metadata, _tables

FORMATS = ["int8", "fp8_e4m3", "fp8_e5m2"]
# (mantissa bits, exponent of the smallest subnormal) of each float8 format
FP8_BITS = {"fp8_e4m3": (3, -9), "fp8_e5m2": (2, -16)}


def _samples(seed: int) -> torch.Tensor:
    """[tokens, KVH, D] values over several magnitudes, one row all zeros, one with an outlier."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(64, KVH, D, generator=g) * torch.logspace(-3, 2, 64)[:, None, None]
    x[3] = 0.0
    x[7, 1, 5] = 1e3
    return x


@pytest.mark.parametrize("name", FORMATS)
def test_roundtrip_error_within_format_bound(name):
    fmt = KV_FORMATS[name]
    x = _samples(1)
    codes, scales = fmt.quantize(x)
    assert codes.dtype == fmt.storage_dtype and scales.dtype == torch.float32
    amax = x.double().abs().amax(-1)
    assert torch.allclose(scales.double(), amax / fmt.max_code, rtol=1e-6, atol=0)
    deq = fmt.dequantize(codes, scales, torch.float64)
    err = (deq - x.double()).abs()
    s = scales.double()[..., None]
    if name == "int8":
        assert codes.min() >= -127 and codes.max() <= 127
        bound = s / 2 * (1 + 1e-5)                      # round to nearest; fp32 division slack
    else:
        mantissa, min_sub = FP8_BITS[name]
        bound = 2.0 ** -(mantissa + 1) * x.double().abs() * (1 + 1e-5) + 2.0 ** (min_sub - 1) * s
        assert (err <= 2.0 ** -mantissa * amax[..., None] + 1e-12).all()     # the amax form
    assert (err <= bound + 1e-12).all(), (err - bound).max()
    assert torch.equal(deq[3], torch.zeros_like(deq[3]))                     # zero rows stay exact


def _dequantized_plane(cache: QuantizedKV, index: int) -> torch.Tensor:
    plane = cache[0, index]
    return plane.format.dequantize(plane.codes, plane.scales, torch.float64)


def _attention64(q, keys, values, rows):
    """float64 attention of ``rows`` (flat row, table, positions) over plain caches [blocks, BS, KVH, D]."""
    out = torch.zeros(q.shape, dtype=torch.float64)
    for row, table, n in rows:
        slots = torch.tensor([table[p // BS] * BS + p % BS for p in range(n)])
        k, v = keys.reshape(-1, KVH, D)[slots], values.reshape(-1, KVH, D)[slots]
        for h in range(H):
            w = torch.softmax(k[:, h // (H // KVH)] @ q[row, h].double() * D ** -0.5, dim=0)
            out[row, h] = w @ v[:, h // (H // KVH)]
    return out


def _perturbation_bound(q, keys, values, dk, dv, rows):
    """Per output element, a bound on |attn(K + dK, V + dV) - attn(K, V)|.

    Scores move by |ds_j| <= c * sum_d |q_d| |dK_jd| (c = D^-1/2); with Delta = max_j |ds_j|
    every probability changes by a factor in [e^-2Delta, e^2Delta], so sum_j |p'_j - p_j| <=
    e^(2 Delta) - 1, and |o' - o| <= (e^(2 Delta) - 1) max_j |V_j| + max_j |dV_j|.
    """
    bound = torch.zeros(q.shape, dtype=torch.float64)
    for row, table, n in rows:
        slots = torch.tensor([table[p // BS] * BS + p % BS for p in range(n)])
        v = values.reshape(-1, KVH, D)[slots].abs()
        ek, ev = dk.reshape(-1, KVH, D)[slots].abs(), dv.reshape(-1, KVH, D)[slots].abs()
        for h in range(H):
            g = h // (H // KVH)
            delta = float((ek[:, g] @ q[row, h].double().abs()).max()) * D ** -0.5
            bound[row, h] = math.expm1(2 * delta) * v[:, g].amax(0) + ev[:, g].amax(0)
    return bound


@pytest.mark.parametrize("name", FORMATS)
def test_backend_attention_over_quantized_cache(name, monkeypatch):
    """Chunks from 0 and after 0 (query pieces), short chunks and decodes all read the
    cache as stored: equal to float64 attention on the dequantised values, and within
    the derived bound of float64 attention on the unquantised ones."""
    monkeypatch.setattr(torch_paged, "QUERY_PIECE", 8)
    torch.manual_seed(0)
    seqs = [(0, 13), (9, 21), (30, 3), (0, 1), (17, 1), (55, 1), (40, 1), (5, 2)]
    tables = _tables([s + n for s, n in seqs], seed=1)
    meta, rows, num_tokens = _metadata(seqs, tables)
    exact = torch.randn(1, 2, NUM_BLOCKS, BS, KVH, D, dtype=torch.float64)
    cache = allocate_kv_tensors(1, NUM_BLOCKS, BS, KVH, D, name, torch.float32, torch.device("cpu"))
    for i in range(2):          # the earlier context, as the engine would have written it
        plane = cache[0, i]
        plane.write(torch.arange(NUM_BLOCKS * BS), exact[0, i].reshape(-1, KVH, D).float())
    q, k, v = (torch.randn(num_tokens, n, D) for n in (H, KVH, KVH))
    for t, slot in enumerate(meta.slot_mapping.tolist()):
        exact[0, 0].view(-1, KVH, D)[slot], exact[0, 1].view(-1, KVH, D)[slot] = k[t].double(), v[t].double()
    backend = get_backend("torch", H, KVH, D)
    step = backend.prepare(meta, cache)
    assert step.ragged is None
    out = backend.forward(q, k, v, cache[0, 0], cache[0, 1], step).view(num_tokens, H, D).double()
    keys, values = _dequantized_plane(cache, 0), _dequantized_plane(cache, 1)
    on_dequantized = _attention64(q, keys, values, rows)
    assert (out - on_dequantized).abs().max() < 1e-5
    on_exact = _attention64(q, exact[0, 0], exact[0, 1], rows)
    bound = _perturbation_bound(q, exact[0, 0], exact[0, 1], keys - exact[0, 0], values - exact[0, 1], rows)
    err = (out - on_exact).abs()
    assert (err <= bound + 1e-5).all(), (err - bound).max()
    print(f"{name}: max |attn error| {err.max():.3g}, bound {bound.max():.3g}")


def test_indexing_block_copy_and_layers():
    cache = allocate_kv_tensors(3, 6, BS, KVH, D, "fp8_e4m3", torch.float32, torch.device("cpu"))
    assert cache.shape == (3, 2, 6, BS, KVH, D) and cache.dtype == torch.float32
    assert cache_kv_dtype(cache) == "fp8_e4m3" and cache_kv_dtype(torch.zeros(1)) == "float32"
    plane = cache[1, 0]
    assert plane.shape == (6, BS, KVH, D) and plane.scales.shape == (6, BS, KVH)
    x = torch.randn(BS, KVH, D)
    plane.write(torch.arange(2 * BS, 3 * BS), x)                 # block 2 of layer 1's K
    src, dst = torch.tensor([2]), torch.tensor([5])
    cache[:, :, dst] = cache[:, :, src]                          # the runner's copy-on-write
    assert torch.equal(cache.codes[:, :, 5], cache.codes[:, :, 2])
    assert torch.equal(cache.scales[:, :, 5], cache.scales[:, :, 2])
    first = cache[:2]                                            # self-draft: the first layers, shared
    assert first.shape[0] == 2 and first.codes.data_ptr() == cache.codes.data_ptr()
    out = torch.empty(1, BS * KVH * D)
    cache[1, 0].gather(torch.tensor([5]), out)
    assert (out.view(BS, KVH, D) - x).abs().max() <= 2 ** -4 * x.abs().amax()


def test_float_cache_stays_a_plain_tensor():
    cache = allocate_kv_tensors(2, 4, BS, KVH, D, "float32", torch.float32, torch.device("cpu"))
    assert type(cache) is torch.Tensor and cache.dtype == torch.float32
    with pytest.raises(ValueError, match="compute dtype"):
        allocate_kv_tensors(2, 4, BS, KVH, D, "float16", torch.float32, torch.device("cpu"))


def test_bytes_per_token_and_capacity_ratio():
    """Default model (30 layers, 3 kv heads, head_dim 64): int8 12,240 B vs fp32 46,080 B."""
    fp32, int8 = (kv_storage(n) for n in ("float32", "int8"))
    assert kv_bytes_per_token(30, 3, 64, fp32.element_bytes, fp32.scale_bytes) == 46_080
    assert kv_bytes_per_token(30, 3, 64, int8.element_bytes, int8.scale_bytes) == 2 * 30 * 3 * (64 + 4) == 12_240
    budget = 17 * 64 * 16 * 12_240            # a whole number of blocks in both
    plans = [kv_cache_plan(budget, 30, 3, 64, s.element_bytes, 16, 512, s.scale_bytes) for s in (fp32, int8)]
    assert plans[1].num_blocks * 17 == plans[0].num_blocks * 64      # x 64/17 = 46,080/12,240 = 3.7647
    assert plans[1].max_tokens / plans[0].max_tokens == 46_080 / 12_240
    assert "4 B scale per (token, kv_head)" in plans[1].explanation and "scale" not in plans[0].explanation
