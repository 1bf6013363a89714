"""Tier 1: what a tensor-parallel layout may be (pure): impossible splits refused with the
reason, a rank's heads, and ``auto`` choosing what the planner chooses on the GPU catalogue."""
from __future__ import annotations

import dataclasses

import pytest

from kvserve.config import ModelConfig, MoEConfig
from kvserve.engine.config import EngineConfig, resolve
from kvserve.errors import InvalidRequestError
from kvserve.parallel.auto import smallest_fitting_tp
from kvserve.parallel.tensor_parallel import check_tensor_parallel, rank_model_config
from kvserve.planner.candidates import PlanInputs
from kvserve.planner.dtypes import kv_dtype, weight_dtype
from kvserve.planner.hardware import CATALOG
from kvserve.planner.memory import valid_tp_degrees
from kvserve.planner.plan import make_plan
from kvserve.planner.presets import PRESETS
from kvserve.planner.workload import Workload

SMOLLM2 = ModelConfig(architecture="llama", vocab_size=49152, hidden_size=576, intermediate_size=1536,
                      num_layers=30, num_heads=9, num_kv_heads=3, head_dim=64, rms_norm_eps=1e-5,
                      rope_theta=1e5, max_position_embeddings=8192, name="smollm2-135m")


def config(heads: int, kv_heads: int, inter: int = 256, moe=None) -> ModelConfig:
    return dataclasses.replace(SMOLLM2, num_heads=heads, num_kv_heads=kv_heads, intermediate_size=inter, moe=moe)


@pytest.mark.parametrize("tp, why", [(2, "9 attention heads are not divisible by 2"),
                                     (3, None), (9, "MLP width 1536 is not divisible by 9"),
                                     (4, "not divisible by 4")])
def test_default_model_splits(tp, why):
    if why is None:
        check_tensor_parallel(SMOLLM2, tp)
    else:
        with pytest.raises(InvalidRequestError, match=why) as err:
            check_tensor_parallel(SMOLLM2, tp)
        assert err.value.param == "tensor_parallel_size"


def test_uneven_kv_heads_mlp_width_and_experts_are_refused():
    with pytest.raises(InvalidRequestError, match="3 KV heads neither divide"):
        check_tensor_parallel(config(12, 3), 2)          # 12 q heads split, 3 KV heads cannot
    with pytest.raises(InvalidRequestError, match="MLP width 250"):
        check_tensor_parallel(config(8, 4, inter=250), 4)
    check_tensor_parallel(config(8, 4, moe=MoEConfig(8, 2, 64)), 2)      # experts split 4 + 4
    with pytest.raises(InvalidRequestError, match="8 experts do not split over 3 ranks"):
        check_tensor_parallel(config(6, 3, inter=96, moe=MoEConfig(8, 2, 64)), 3)
    with pytest.raises(InvalidRequestError, match=">= 1"):
        check_tensor_parallel(config(8, 4), 0)


def test_rank_config_splits_or_replicates_kv_heads():
    split = rank_model_config(config(8, 4), 2)
    assert (split.num_heads, split.num_kv_heads, split.intermediate_size) == (4, 2, 128)
    replicated = rank_model_config(config(8, 2), 4)      # GQA: 2 KV heads over 4 ranks
    assert (replicated.num_heads, replicated.num_kv_heads) == (2, 1)


def test_resolve_tensor_parallel_size():
    assert resolve(EngineConfig(), SMOLLM2, False).tensor_parallel_size == 1
    assert resolve(EngineConfig(tensor_parallel_size="3"), SMOLLM2, False).tensor_parallel_size == 3
    picked = resolve(EngineConfig(tensor_parallel_size="auto"), SMOLLM2, False,
                     pick_tensor_parallel=lambda *args: (3, "auto: test"))
    assert (picked.tensor_parallel_size, picked.tensor_parallel_reason) == (3, "auto: test")
    for bad in (0, -2, "two", None):
        with pytest.raises(InvalidRequestError, match="tensor_parallel_size"):
            resolve(EngineConfig(tensor_parallel_size=bad), SMOLLM2, False)


def test_auto_on_cpu_is_one_with_the_reason():
    from kvserve.parallel.auto import pick_tensor_parallel
    tp, why = pick_tensor_parallel(SMOLLM2, "cpu", "float32", "float32", 8192, 16, 1024, 64)
    assert tp == 1 and "share one host's memory" in why


@pytest.mark.parametrize("gpu", ["a100-80gb", "h100-sxm", "h200", "l4"])
def test_auto_tp_is_the_planners_choice_on_the_catalogue(gpu):
    """For every preset: the engine's ``auto`` equals ``kvserve plan``'s TP for one
    sequence at the model's full context (where the planner's choice is within a node)."""
    hw, checked = CATALOG[gpu], 0
    for name, model in PRESETS.items():
        context = min(model.max_context, 32768)
        plan_inputs = PlanInputs(model, hw, weight_dtype("bf16"), kv_dtype("bf16"),
                                 Workload(context=context, concurrency=1))
        try:
            planned = int(make_plan(plan_inputs).figure("tp").value)
        except InvalidRequestError:
            planned = None                                    # fits on no TP at all
        if planned is None or planned > hw.gpus_per_node:
            with pytest.raises(InvalidRequestError, match="no tensor-parallel size"):
                smallest_fitting_tp(model, hw, "bfloat16", "bfloat16", context, hw.gpus_per_node, 16, 8192, 256)
            continue
        tp, why = smallest_fitting_tp(model, hw, "bfloat16", "bfloat16", context, hw.gpus_per_node,
                                      16, 8192, 256)
        assert tp == planned, (name, gpu, why)
        assert tp in valid_tp_degrees(model, hw.gpus_per_node) and f"TP {tp}:" in why
        checked += 1
    assert checked >= 5
