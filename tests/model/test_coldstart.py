"""Tier 2: the cold-start mitigations change no output. An engine built with a warm-up pass
and from the host-memory weight cache (a miss that stores, then a hit) gives the same greedy
tokens as the shared engine; its start-up phases are recorded; one measured child start
reports the three layers."""
from __future__ import annotations

import pytest

from kvserve.sampling.params import SamplingParams

pytestmark = pytest.mark.model

PROMPTS = ["Write a haiku about paged memory.", "What is the capital of France?", "def fib(n):"]


def test_warmup_and_weight_cache_keep_outputs(llm, model_path, tmp_path):
    from kvserve import LLM
    from kvserve.coldstart.weight_cache import HostWeightCache
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    reference = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, greedy)]
    cache = HostWeightCache(str(tmp_path / "weights"))
    for attempt in ("miss", "hit"):
        engine = LLM(model_path, dtype="float32", kv_cache_bytes=64 * 2**20, warmup=True,
                     weight_cache_dir=cache.root)
        assert [o.outputs[0].token_ids for o in engine.generate(PROMPTS, greedy)] == reference, attempt
        timings = engine.engine.start_timings
        assert {"checkpoint_s", "weights_s", "kv_cache_s", "warmup_s"} <= set(timings), timings
        assert len(cache.entries()) == 1 and cache.get(model_path) is not None
        engine.engine.check_integrity()


def test_one_measured_child_start():
    from kvserve.coldstart.measure import run_child
    result = run_child({"model": None, "kv_cache_bytes": 32 * 2**20, "threads": 1})
    assert result["runtime_s"] > 0 and result["weights_s"] > 0 and result["warmup_s"] >= 0
    assert result["to_first_token_s"] > result["runtime_s"] + result["weights_s"]
    assert result["detail"]["steady_request_s"] > 0
