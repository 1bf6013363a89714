"""Tier 2: weights swapped in place and sleep / wake (engine/weight_swap.py), on tiny random
Llama folders of the same shape drawn from two seeds (and one of another shape)."""
from __future__ import annotations

import pytest

from kvserve.errors import EngineBusyError, InvalidRequestError
from kvserve.sampling.params import SamplingParams
from tests.support.tiny_models import save_tiny_hf

pytestmark = pytest.mark.model

PROMPT = "The paged KV cache keeps every block of a prompt so the next turn " * 4
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def folders(tmp_path_factory, model_path):
    made = {}
    for name, seed, hidden in (("a", 0, 64), ("b", 1, 64), ("wide", 0, 128)):
        folder = tmp_path_factory.mktemp(name)
        save_tiny_hf("llama", folder, model_path, seed=seed, hidden=hidden, intermediate=2 * hidden)
        made[name] = str(folder)
    return made


def engine(folder):
    from kvserve import LLM
    return LLM(folder, dtype="float32", kv_cache_bytes=8 * 2**20, num_threads=1)


def test_a_load_mid_traffic_never_serves_old_blocks(folders):
    llm = engine(folders["a"])
    first = llm.generate([PROMPT], GREEDY)[0]
    assert llm.generate([PROMPT], GREEDY)[0].num_cached_tokens > 0            # the prompt is cached
    assert llm.engine.load_weights(folders["b"])["weight_epoch"] == 1
    after = llm.generate([PROMPT], GREEDY)[0]
    assert after.num_cached_tokens == 0                                       # nothing from before the load
    fresh = engine(folders["b"]).generate([PROMPT], GREEDY)[0]
    assert after.outputs[0].token_ids == fresh.outputs[0].token_ids != first.outputs[0].token_ids
    assert llm.generate([PROMPT], GREEDY)[0].num_cached_tokens > 0            # the new epoch caches again
    llm.engine.check_integrity()


def test_load_refuses_in_flight_requests_and_other_shapes(folders):
    from kvserve.engine.request import EngineRequest
    llm = engine(folders["a"])
    llm.engine.add_request(EngineRequest("busy", [5, 6, 7, 8], GREEDY))
    with pytest.raises(EngineBusyError, match="in flight"):
        llm.engine.load_weights(folders["b"])
    while llm.engine.has_unfinished():
        llm.engine.step()
    with pytest.raises(InvalidRequestError, match="hidden_size"):
        llm.engine.load_weights(folders["wide"])
    assert llm.engine.weight_epoch == 0


def test_sleep_then_wake_restores_greedy_outputs(folders):
    llm = engine(folders["a"])
    before = [o.outputs[0].token_ids for o in llm.generate([PROMPT, "def add(a, b):"], GREEDY)]
    freed = llm.engine.sleep()
    assert freed["kv_bytes_freed"] == llm.engine.kv_plan.bytes_per_block * llm.engine.kv_plan.num_blocks
    assert llm.engine.runner.kv_cache is None and llm.engine.stats().kv_blocks_cached == 0
    with pytest.raises(EngineBusyError, match="asleep"):
        llm.generate(["hello"], GREEDY)
    with pytest.raises(EngineBusyError, match="asleep"):
        llm.engine.load_weights(folders["b"])
    llm.engine.wake()
    after = [o.outputs[0].token_ids for o in llm.generate([PROMPT, "def add(a, b):"], GREEDY)]
    assert after == before
    llm.engine.check_integrity()
