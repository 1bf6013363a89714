"""Property tests of the planner's arithmetic (hypothesis)."""
from __future__ import annotations

import dataclasses

from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from kvserve.planner.candidates import PlanInputs
from kvserve.planner.dtypes import kv_dtype, weight_dtype
from kvserve.planner.errors import ImpossibleInputError
from kvserve.planner.hardware import CATALOG
from kvserve.planner.kv_memory import kv_bytes_per_token_per_gpu, kv_cache_plan, model_kv_bytes_per_token
from kvserve.planner.memory import replica_memory, valid_tp_degrees, weight_bytes
from kvserve.planner.models import MLASpec, ModelSpec
from kvserve.planner.plan import make_plan
from kvserve.planner.presets import PRESETS
from kvserve.planner.roofline import cost_model, decode_work, step_time
from kvserve.planner.workload import Workload

FAST = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@st.composite
def models(draw) -> ModelSpec:
    kv_heads = draw(st.sampled_from([1, 2, 3, 4, 8, 16]))
    group = draw(st.sampled_from([1, 2, 3, 4, 8]))
    head_dim = draw(st.sampled_from([64, 96, 128, 256]))
    layers = draw(st.integers(1, 128))
    mla = None
    if draw(st.booleans()) and draw(st.booleans()):
        mla = MLASpec(kv_lora_rank=draw(st.sampled_from([256, 512])), qk_rope_head_dim=64,
                      qk_nope_head_dim=128, v_head_dim=128)
    return ModelSpec(name="h", num_layers=layers, hidden_size=kv_heads * group * head_dim,
                     intermediate_size=draw(st.integers(256, 30000)), vocab_size=draw(st.integers(1000, 200000)),
                     num_heads=kv_heads * group, num_kv_heads=kv_heads, head_dim=head_dim, mla=mla)


@FAST
@given(models(), st.integers(1, 1_000_000), st.integers(2, 16))
def test_kv_bytes_linear_in_context(model, tokens, factor):
    per = model_kv_bytes_per_token(model, 2).value
    plan = kv_cache_plan(per * tokens, model.num_layers, model.num_kv_heads, model.head_dim, 2, 1, 1)
    if model.mla is None:
        assert plan.max_tokens == tokens                         # budget of n tokens holds n tokens
    assert per * tokens * factor == model_kv_bytes_per_token(model, 2).value * (tokens * factor)


@FAST
@given(models(), st.sampled_from(["fp8", "int8"]))
def test_eight_bit_kv_halves_bf16(model, eight_bit):
    bf16 = model_kv_bytes_per_token(model, kv_dtype("bf16").bytes).value
    assert model_kv_bytes_per_token(model, kv_dtype(eight_bit).bytes).value * 2 == bf16
    assert model_kv_bytes_per_token(model, kv_dtype("fp32").bytes).value == 2 * bf16


@FAST
@given(st.integers(1, 64), st.integers(1, 16), st.integers(1, 128))
def test_tp_never_splits_kv_heads_unevenly(kv_heads, group, max_tp):
    model = ModelSpec(name="t", num_layers=2, hidden_size=kv_heads * group * 64, intermediate_size=512,
                      vocab_size=1000, num_heads=kv_heads * group, num_kv_heads=kv_heads, head_dim=64)
    degrees = valid_tp_degrees(model, max_tp)
    assert 1 in degrees
    for tp in degrees:
        assert model.num_heads % tp == 0
        assert kv_heads % tp == 0 or tp % kv_heads == 0
        per_gpu = kv_bytes_per_token_per_gpu(model, 2, tp).value
        assert per_gpu * min(tp, kv_heads) == model_kv_bytes_per_token(model, 2).value


@FAST
@given(st.sampled_from(sorted(PRESETS)), st.sampled_from(sorted(CATALOG)),
       st.floats(1.0, 4.0), st.floats(1.0, 4.0),
       st.sampled_from([512, 2048, 8192, 32768]), st.integers(1, 512),
       st.sampled_from(["bf16", "fp8", "int4"]))
def test_larger_gpu_never_needs_larger_tp(name, gpu, mem_scale, bw_scale, context, concurrency, wd):
    model = PRESETS[name]
    assume(context <= model.max_context)
    base = CATALOG[gpu]
    bigger = dataclasses.replace(base, memory_bytes=base.memory_bytes * mem_scale,
                                 mem_bandwidth=base.mem_bandwidth * bw_scale)
    w = Workload(context=context, concurrency=concurrency)

    def tp(hw):
        return int(make_plan(PlanInputs(model, hw, weight_dtype(wd), kv_dtype("bf16"), w)).figure("tp").value)

    try:
        small = tp(base)
    except ImpossibleInputError:
        return                                    # nothing fits the smaller GPU: nothing to compare
    assert tp(bigger) <= small


@FAST
@given(st.sampled_from(sorted(PRESETS)), st.sampled_from(sorted(CATALOG)), st.sampled_from([1024, 8192]))
def test_kv_capacity_grows_with_tp_and_weights_shrink(name, gpu, context):
    model, hw = PRESETS[name], CATALOG[gpu]
    wb = weight_bytes(model, weight_dtype("bf16")).value
    prev = None
    for tp in valid_tp_degrees(model, 16):
        mem = replica_memory(model, hw, wb, 2, tp, context)
        assert mem.weights_per_gpu * tp == wb
        if prev is not None:
            assert mem.kv_tokens >= prev.kv_tokens
        prev = mem


@FAST
@given(st.sampled_from(sorted(PRESETS)), st.integers(1, 300), st.integers(1, 299), st.integers(1, 8192))
def test_decode_step_time_grows_with_batch_and_beats_no_bound(name, b, extra, context):
    model = PRESETS[name]
    tp = valid_tp_degrees(model, 8)[-1]
    cm = cost_model(model, CATALOG["h100-sxm"], weight_dtype("bf16"), kv_dtype("bf16"), tp)
    small, large = step_time(cm, decode_work(b, context)), step_time(cm, decode_work(b + extra, context))
    assert large.total_s >= small.total_s
    peak = step_time(cm, decode_work(b, context), peak=True)
    assert peak.total_s <= small.total_s                       # efficiencies only ever slow it down
    assert peak.total_s >= peak.weight_bytes / cm.hw.mem_bandwidth   # never faster than streaming weights
