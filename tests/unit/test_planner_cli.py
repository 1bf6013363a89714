"""Tier 1: the planner's CLI, inputs (config.json, hardware files), refusals, plots, the
scheduler replay and the calibration fit. No engine, no network (the default GGUF as
input: tests/model/test_planner_gguf.py)."""
from __future__ import annotations

import dataclasses
import json
import random

import pytest

from kvserve.planner.cli import main
from kvserve.planner.hardware import CATALOG, hardware_to_dict, load_hardware_file, save_hardware_file
from kvserve.planner.model_io import model_from_hf_config, resolve_model
from kvserve.planner.models import param_counts
from kvserve.planner.presets import preset

REQUIRED_KEYS = {"kv_bytes_per_token", "weight_bytes", "tp", "replicas", "kv_tokens_per_replica",
                 "max_concurrency", "decode_ms_per_token_bs1", "ridge_batch", "output_tokens_per_s_per_gpu",
                 "gpus", "usd_per_month", "usd_per_million_output_tokens"}


def run_json(capsys, *argv) -> tuple[int, dict]:
    code = main(["plan", *argv, "--json"])
    return code, json.loads(capsys.readouterr().out)


def test_plan_json_has_every_documented_key(capsys):
    code, out = run_json(capsys, "--model", "llama-3-70b", "--gpu", "h100-sxm", "--context", "8192",
                         "--concurrency", "32")
    assert code == 0
    assert REQUIRED_KEYS <= set(out)
    assert out["kv_bytes_per_token"] == 327_680 and out["tp"] == 4 and out["gpus"] == 4
    assert set(out["arithmetic"]) >= REQUIRED_KEYS - {"gpus"}
    assert all(isinstance(out["arithmetic"][k], str) and out["arithmetic"][k] for k in REQUIRED_KEYS)


def test_plan_with_speculation_reports_spec_keys(capsys):
    code, out = run_json(capsys, "--model", "llama-3-8b", "--gpu", "l4", "--context", "2048",
                         "--concurrency", "4", "--spec-alpha", "0.8", "--spec-k", "4")
    assert code == 0
    assert out["spec_expected_tokens_per_step"] == pytest.approx(3.3616, abs=1e-4)
    assert out["spec_speedup"] > 1
    assert "spec_breakeven_batch" in out


def test_table_shows_figures_with_their_arithmetic(capsys):
    assert main(["plan", "--model", "deepseek-v3", "--gpu", "h200", "--weight-dtype", "fp8",
                 "--context", "32768", "--concurrency", "16"]) == 0
    text = capsys.readouterr().out
    assert "kv_bytes_per_token" in text and "MLA latent: 61 layers x (512 kv_lora_rank + 64 rope dim)" in text
    assert "experts_per_gpu" in text and "256 experts / EP 8 = 32" in text
    assert "Memory by TP degree" in text and "<- chosen" in text


@pytest.mark.parametrize("argv, needle", [
    (["--model", "llama-3-8b", "--gpu", "h100-sxm", "--claimed-tokens-per-s", "1e7"], "above the roofline"),
    (["--model", "llama-3-8b", "--spec-alpha", "1.5"], "not a probability"),
    (["--model", "llama-3-70b", "--tp", "3"], "TP must divide"),
    (["--model", "llama-3-8b", "--context", "100000"], "context window"),
    (["--model", "llama-3.1-405b", "--gpu", "l4", "--max-tp", "8"], "does not fit"),
    (["--model", "no-such-model"], "unknown model preset"),
    (["--gpu", "tpu-v9"], "unknown GPU"),
    (["--weight-dtype", "int3"], "unknown weight dtype"),
    (["--rps", "-1"], "--rps must be a positive"),
    (["--prompt-tokens", "9-3", "--rps", "1"], "--prompt-tokens"),
])
def test_refusals_are_typed_with_a_message(capsys, argv, needle):
    code, out = run_json(capsys, *argv)
    assert code == 2
    assert needle in out["error"]["message"]
    assert out["error"]["type"] == "invalid_request_error"


def test_plausible_claim_is_accepted(capsys):
    code, out = run_json(capsys, "--model", "llama-3-8b", "--gpu", "h100-sxm", "--context", "2048",
                         "--concurrency", "64", "--claimed-tokens-per-s", "2000")
    assert code == 0


def test_traffic_mode_sizes_fleet_and_tight_ttft_raises_tp(capsys):
    base = ["--model", "llama-3-70b", "--gpu", "h100-sxm", "--rps", "40", "--prompt-tokens", "1500:6000",
            "--output-tokens", "150:400", "--peak-to-mean", "2", "--tpot-ms", "50"]
    code, loose = run_json(capsys, *base, "--ttft-p99-ms", "5000")
    assert code == 0 and loose["replicas"] >= 1 and not loose["slo_violations"]
    code, tight = run_json(capsys, *base, "--ttft-p99-ms", "600")
    assert code == 0 and tight["tp"] >= loose["tp"]
    assert tight["ttft_p99_ms"] <= 600 or tight["slo_violations"]
    assert loose["usd_per_million_output_tokens"] > 0 and "usd_per_million_output_tokens_at_capacity" in loose


def test_hf_config_json_input(tmp_path, capsys):
    cfg = {"architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "hidden_size": 7168,
           "intermediate_size": 18432, "moe_intermediate_size": 2048, "num_hidden_layers": 61,
           "num_attention_heads": 128, "num_key_value_heads": 128, "vocab_size": 129280,
           "n_routed_experts": 256, "n_shared_experts": 1, "num_experts_per_tok": 8, "first_k_dense_replace": 3,
           "q_lora_rank": 1536, "kv_lora_rank": 512, "qk_rope_head_dim": 64, "qk_nope_head_dim": 128,
           "v_head_dim": 128, "max_position_embeddings": 163840, "tie_word_embeddings": False}
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))
    m = resolve_model(str(tmp_path))
    assert m.mla is not None and m.moe is not None
    assert param_counts(m).total == param_counts(preset("deepseek-v3")).total
    mixtral = model_from_hf_config({"hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
                                    "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 32000,
                                    "num_local_experts": 8, "num_experts_per_tok": 2})
    assert param_counts(mixtral).total == param_counts(preset("mixtral-8x7b")).total
    code, out = run_json(capsys, "--model", str(path), "--gpu", "h200", "--weight-dtype", "fp8",
                         "--context", "8192", "--concurrency", "8")
    assert code == 0 and out["kv_bytes_per_token"] == 70_272


def test_hardware_file_round_trip_and_price_override(tmp_path, capsys):
    hw = dataclasses.replace(CATALOG["h100-sxm"], name="my-h100", price_per_hour=1.0)
    path = save_hardware_file(hw, str(tmp_path / "hw.json"))
    assert load_hardware_file(path) == hw
    _, a = run_json(capsys, "--model", "llama-3-8b", "--gpu-file", path)
    _, b = run_json(capsys, "--model", "llama-3-8b", "--gpu-file", path, "--price-per-hour", "2.0")
    assert b["usd_per_month"] == pytest.approx(2 * a["usd_per_month"])
    bad = hardware_to_dict(hw) | {"mem_efficiency": 1.5}
    (tmp_path / "bad.json").write_text(json.dumps(bad))
    code, out = run_json(capsys, "--model", "llama-3-8b", "--gpu-file", str(tmp_path / "bad.json"))
    assert code == 2 and "cannot beat its own peak" in out["error"]["message"]


def test_a_profiled_entry_plans_in_the_dtypes_its_engine_ran(tmp_path, capsys):
    # a CPU without native bf16 runs the engine in fp32 whatever the checkpoint holds: planning
    # that host in the checkpoint's bf16 priced every GEMM at its emulated bf16 rate
    from types import MappingProxyType
    profiled = dataclasses.replace(CATALOG["h100-sxm"], name="profiled",
                                   calibration=MappingProxyType({"weight_dtype": "fp32", "kv_cache_dtype": "float32"}))
    path = save_hardware_file(profiled, str(tmp_path / "profiled.json"))
    _, auto = run_json(capsys, "--model", "llama-3-8b", "--gpu-file", path)
    assert auto["weight_dtype"] == "fp32" and auto["kv_dtype"] == "fp32"
    _, given = run_json(capsys, "--model", "llama-3-8b", "--gpu-file", path, "--weight-dtype", "bf16",
                        "--kv-dtype", "int8")
    assert given["weight_dtype"] == "bf16" and given["kv_dtype"] == "int8"
    _, catalog = run_json(capsys, "--model", "llama-3-8b", "--gpu", "h100-sxm")      # no profile: native, bf16 KV
    assert catalog["weight_dtype"] == "bf16" and catalog["kv_dtype"] == "bf16"
    assert auto["weight_bytes"] == 2 * catalog["weight_bytes"]


def test_custom_hardware_figures(capsys):
    base = ["--model", "llama-3-70b", "--context", "8192", "--concurrency", "32"]
    _, h100 = run_json(capsys, *base, "--gpu", "h100-sxm")
    _, big = run_json(capsys, *base, "--gpu", "h100-sxm", "--memory-gib", "180", "--bandwidth-gbs", "6700")
    assert big["gpu"] == "h100-sxm (custom)" and big["tp"] <= h100["tp"]
    assert big["decode_bound_ms_per_token_bs1"] < h100["decode_bound_ms_per_token_bs1"]
    code, out = run_json(capsys, *base, "--memory-gib", "-5")
    assert code == 2 and "positive memory" in out["error"]["message"]


def test_expert_parallel_adds_all_to_all(capsys):
    base = ["--model", "mixtral-8x7b", "--gpu", "h100-sxm", "--context", "4096", "--concurrency", "64", "--tp", "8"]
    _, tp_only = run_json(capsys, *base)
    _, ep = run_json(capsys, *base, "--expert-parallel")
    assert ep["experts_per_gpu"] == 1 and ep["tpot_ms"] > tp_only["tpot_ms"]
    assert "included in the step time" in ep["arithmetic"]["all_to_all_s_per_step"]


def test_plots_are_written(tmp_path, capsys):
    assert main(["plan", "--model", "llama-3-70b", "--gpu", "h100-sxm", "--context", "8192",
                 "--concurrency", "32", "--plot", str(tmp_path)]) == 0
    for name in ("planner_memory.png", "planner_roofline.png"):
        data = (tmp_path / name).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and 5_000 < len(data) < 400_000


def test_scheduler_replay_matches_the_engine_scheduler():
    from kvserve.engine.kv.block_pool import BlockPool
    from kvserve.engine.kv.manager import KVCacheManager
    from kvserve.engine.request import EngineRequest
    from kvserve.engine.scheduler import Scheduler, SchedulerConfig
    from kvserve.engine.step import SampledToken, StepResult
    from kvserve.planner.simulate import SchedulerLimits, schedule_offline
    from kvserve.sampling.params import SamplingParams

    rng = random.Random(3)
    requests = [(rng.randint(1, 300), rng.randint(1, 40)) for _ in range(40)]
    limits = SchedulerLimits(max_num_seqs=16, max_num_batched_tokens=256)
    sched = Scheduler(SchedulerConfig(16, 256), KVCacheManager(BlockPool(100_000, 16)))
    for i, (p, o) in enumerate(requests):
        params = SamplingParams(max_tokens=o, temperature=0, ignore_eos=True)
        sched.add_request(EngineRequest(str(i), list(range(1, p + 1)), params, eos_token_ids=frozenset([0])))
    real = []
    while sched.has_unfinished():
        plan = sched.schedule()
        real.append((tuple((s.start_position, s.num_tokens) for s in plan.scheduled),
                     sum(s.sample for s in plan.scheduled)))
        sched.update(plan, StepResult({s.seq_id: SampledToken(7) for s in plan.scheduled if s.sample}))
    replay = [(s.chunks, s.num_sampled) for s in schedule_offline(requests, limits)]
    assert replay == real


def test_calibration_fit_recovers_known_efficiencies():
    from kvserve.planner.calibrate import RunSample, calibrated_hardware, fit_efficiencies
    from kvserve.planner.dtypes import kv_dtype, weight_dtype
    from kvserve.planner.profile import FULL_RUNS
    from kvserve.planner.roofline import cost_model
    from kvserve.planner.simulate import SchedulerLimits, predict_run

    raw = dataclasses.replace(CATALOG["l4"], name="cpu", mem_bandwidth=20e9,
                              flops={"fp32": 100e9}, mem_efficiency=1.0, kv_efficiency=1.0,
                              flops_efficiency=1.0, kv_read_mode="padded")
    model = preset("smollm2-135m")
    truth = calibrated_hardware(raw, 0.6, 0.5, 0.3, 2e-3, 1e-4, 5e-3, e_gemv=1.0)
    limits = SchedulerLimits(64, 1024)
    samples = [RunSample(lengths, n, predict_run(cost_model(model, truth, weight_dtype("fp32"),
                                                            kv_dtype("fp32"), 1),
                                                 [(p, n) for p in lengths], limits)["seconds"])
               for lengths, n in FULL_RUNS]
    fit = fit_efficiencies(cost_model(model, raw, weight_dtype("fp32"), kv_dtype("fp32"), 1), samples, limits)
    assert fit.rms_relative_error < 0.02
    assert fit.mem_efficiency == pytest.approx(0.6, rel=0.15)
    assert fit.flops_efficiency == pytest.approx(0.5, rel=0.15)
    assert fit.gemv_efficiency == 1.0
    assert fit.step_overhead_s == pytest.approx(2e-3, rel=0.25)
    assert all(abs(r["error"]) < 0.05 for r in fit.per_run)


def test_time_runs_uses_fresh_prompts_and_best_time(monkeypatch):
    import time

    from kvserve.planner import profile
    from kvserve.planner.profile import time_runs

    seen = []

    def generate(prompts, n):                   # takes at least 10 ms per output token asked
        seen.append((tuple(map(tuple, prompts)), n))
        time.sleep(0.01 * n)
    samples = time_runs(generate, [((4, 4), 2), ((3,), 1)], vocab_size=1000, repeats=2)
    assert [s.prompts for s in samples] == [(4, 4), (3,)]
    assert len(seen) == 4 and seen[0][0] != seen[1][0]            # never the same prompt twice
    # The best of the rounds is still a real wall time of that run: every round slept >= 0.01 x n.
    assert [s.max_tokens for s in samples] == [2, 1]
    assert all(s.seconds >= 0.01 * s.max_tokens for s in samples), samples
    # Best of ``repeats`` whole rounds, on a clock that time_runs reads: a fake one, advanced
    # by each call (run 0 takes 5 s then 3 s, run 1 takes 1 s then 2 s).
    now = [0.0]
    durations = iter([5.0, 1.0, 3.0, 2.0])      # round 1: run 0, run 1; round 2: run 0, run 1

    def fake_generate(prompts, n):
        now[0] += next(durations)
    monkeypatch.setitem(profile.CLOCKS, "wall", lambda: now[0])
    best = time_runs(fake_generate, [((4, 4), 2), ((3,), 1)], vocab_size=1000, repeats=2)
    assert [s.seconds for s in best] == [3.0, 1.0]


def test_profile_measures_gemm_in_bf16_too_and_the_entry_uses_it_for_bf16_weights():
    """The CPU engine runs bf16: a roofline on fp32 GEMM alone predicted its prefill too slow
    (quick profile rms error 39% -> 9% with the bf16 figure, on an AVX-512 BF16 Xeon)."""
    from kvserve.planner.profile import base_entry, measure_gemm_flops
    gemm = measure_gemm_flops(n=64, repeats=1)
    assert gemm["fp32_flops"] > 0 and gemm["bf16_flops"] > 0
    hw = base_entry("t", {"bytes_per_s": 1e10}, {"fp32_flops": 1e11, "bf16_flops": 3e11}, 0.0)
    assert hw.flops_for("bf16") == (3e11, "bf16") and hw.flops_for("fp32") == (1e11, "fp32")
    assert base_entry("t", {"bytes_per_s": 1e10}, {"fp32_flops": 1e11}, 0.0).flops_for("bf16") == (1e11, "fp32")
