"""Tier 2: prefill/decode disaggregation on the real model (CPU, fp32, greedy).

A prefill engine and a decode engine run as two processes (kvserve/disagg/); long
prompts are prefilled on the first and their full KV blocks move through shared memory
into the second's prefix cache. Outputs must equal a unified engine's token for token,
the blocks must demonstrably move (counters), blocks the decode engine already caches
must not move, and aborts at every stage of a transfer must leave both engines' block
accounting exact.
"""
from __future__ import annotations

import pytest

from kvserve.disagg.driver import DisaggConfig, DisaggregatedEngines, Stage
from kvserve.engine.request import EngineRequest
from kvserve.sampling.params import SamplingParams

pytestmark = pytest.mark.model
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
THRESHOLD = 256
BLOCK = 16
STAGING = 512                     # transfer room: ~7 long prompts in flight at once


@pytest.fixture(scope="module")
def engines(model_path):
    common = {"model": model_path, "dtype": "float32", "num_threads": 1, "max_num_seqs": 64,
              "max_num_batched_tokens": 1024}
    with DisaggregatedEngines(common, DisaggConfig(threshold_tokens=THRESHOLD, staging_blocks=STAGING),
                              prefill_config={"kv_cache_bytes": 512 * 2**20, "num_threads": 2},
                              decode_config={"kv_cache_bytes": 768 * 2**20}) as pair:
        yield pair


def unified(llm, requests: list[EngineRequest]) -> dict[str, list[int]]:
    """The reference: the same requests on one in-process engine."""
    engine, out = llm.engine, {r.request_id: [] for r in requests}
    for r in requests:
        engine.add_request(r)
    while engine.has_unfinished():
        for update in engine.step():
            if update.request_id in out:
                out[update.request_id].extend(update.new_token_ids)
    return out


def make(tag: str, prompts: list[list[int]], **kwargs) -> list[EngineRequest]:
    return [EngineRequest(f"{tag}-{i}", list(p), GREEDY, **kwargs) for i, p in enumerate(prompts)]


def full_blocks(prompt: list[int]) -> int:
    return (len(prompt) - 1) // BLOCK


def assert_exact(engines: DisaggregatedEngines) -> None:
    """No request holds anything: both engines' pools are free + cached-only, every lock and
    staging slot given back, no export pending."""
    reports = engines.check_integrity()
    for report in reports.values():
        assert report.num_used_blocks == 0 and report.num_pending_exports == 0
        assert report.num_free_blocks + report.num_cached_only_blocks == report.num_blocks
    assert engines.transfer.reserved == [] and engines.transfer.num_free_blocks == STAGING


def test_outputs_equal_unified_and_long_prompts_move(engines, llm, prompts):
    requests = make("mix", prompts)
    reference = unified(llm, make("ref-mix", prompts))
    before = vars(engines.counters).copy()
    results = engines.generate(requests)
    for i, r in enumerate(requests):
        assert results[r.request_id].token_ids == [reference[f"ref-mix-{i}"]], f"prompt {i} ({len(prompts[i])} tokens)"
        assert results[r.request_id].finish_reasons == ["length"]
    long = [p for p in prompts if len(p) >= THRESHOLD]
    c = engines.counters
    assert len(long) >= 8
    assert c.num_disaggregated - before["num_disaggregated"] == len(long)
    assert c.num_unified - before["num_unified"] == len(prompts) - len(long)
    sent = c.blocks_sent - before["blocks_sent"]
    skipped = c.blocks_skipped - before["blocks_skipped"]
    assert sent + skipped == sum(full_blocks(p) for p in long)
    assert sent > 0.9 * sum(full_blocks(p) for p in long)
    assert c.blocks_received + c.blocks_present_on_import == c.blocks_sent and c.blocks_dropped == 0
    assert_exact(engines)


def test_decode_side_prefix_hits_skip_the_transfer(engines, llm, prompts):
    long = sorted((p for p in prompts if len(p) >= THRESHOLD), key=len)[:3]
    engines.generate(make("warm", long))                    # cached on the decode side now (at the latest)
    tail = max(prompts, key=len)[-300:]
    extended = [p + tail + list(range(50, 50 + j)) for j, p in enumerate(long)]
    requests = make("again", long) + make("ext", extended)
    reference = unified(llm, make("ref-again", long) + make("ref-ext", extended))
    before = vars(engines.counters).copy()
    results = engines.generate(requests)
    for r in requests:
        assert results[r.request_id].token_ids == [reference["ref-" + r.request_id]], r.request_id
    c = engines.counters
    # the same long prompts again: decode hits them all, nothing is prefilled or moved for them;
    # the extended ones move only their ~300-token tail, the cached stem is skipped
    assert c.num_unified - before["num_unified"] == len(long)
    assert c.num_disaggregated - before["num_disaggregated"] == len(extended)
    # (the decode engine computed every token of a stem, so it caches len // 16 of its blocks,
    # one more than the stem's own full blocks when the stem ends on a block boundary)
    stem_blocks = [len(p) // BLOCK for p in long]
    assert c.blocks_skipped - before["blocks_skipped"] == sum(stem_blocks)
    assert c.blocks_sent - before["blocks_sent"] == sum(full_blocks(e) - s for s, e in zip(stem_blocks, extended))
    assert_exact(engines)


def drive_aborts(engines: DisaggregatedEngines, requests: list[EngineRequest], targets: dict[str, Stage]) -> dict:
    """Abort each targeted request as soon as it is seen at its stage (or past it); the
    stages they were actually aborted at."""
    order = list(Stage)
    aborted_at = {}
    for r in requests:
        engines.add_request(r)
    for rid, target in targets.items():
        if target is Stage.QUERYING:
            aborted_at[rid] = engines.stage(rid)
            engines.abort(rid)
    while engines.has_unfinished():
        engines.poll(0.01)
        for rid, target in targets.items():
            stage = engines.stage(rid)
            if rid not in aborted_at and stage is not Stage.DONE and order.index(stage) >= order.index(target):
                aborted_at[rid] = stage
                engines.abort(rid)
    return aborted_at


def test_aborts_mid_transfer_keep_both_engines_exact(engines, llm, prompts):
    long = [p[:300] for p in prompts if len(p) >= THRESHOLD][:7]     # 7 prompts of 300 tokens
    requests = make("abort", long, cache_salt="abort-test")       # a fresh namespace: nothing cached anywhere
    targets = {"abort-0": Stage.QUERYING, "abort-1": Stage.PREFILLING, "abort-2": Stage.PREFILLING,
               "abort-3": Stage.IMPORTING, "abort-4": Stage.IMPORTING, "abort-5": Stage.DECODING}
    aborted_at = drive_aborts(engines, requests, targets)
    results = {r.request_id: engines.take_result(r.request_id) for r in requests}
    in_flight = [rid for rid, stage in aborted_at.items() if stage in (Stage.PREFILLING, Stage.IMPORTING)]
    print("aborted at", {rid: s.value for rid, s in aborted_at.items()})
    assert len(in_flight) >= 2, aborted_at
    for rid in targets:
        assert "abort" in results[rid].finish_reasons or results[rid].finish_reasons == ["length"]
    reference = unified(llm, make("ref-abort", long[6:], cache_salt="abort-test"))
    assert results["abort-6"].token_ids == [reference["ref-abort-0"]]
    assert_exact(engines)
    # the engines still serve exactly after the aborts, from the blocks the aborts left cached
    again = engines.generate(make("after", long[:3], cache_salt="abort-test"))
    reference = unified(llm, make("ref-after", long[:3], cache_salt="abort-test"))
    for i in range(3):
        assert again[f"after-{i}"].token_ids == [reference[f"ref-after-{i}"]]
    assert_exact(engines)
