"""Tier 1: `kvserve cluster serve`'s autoscaling options -> AutoscaleSettings (capacity from
the given figure, the planner on a hardware entry, or the stated fallback when no profile
exists), and the ingress's bounded wait for a replica (assign_wait.py)."""
from __future__ import annotations

import argparse
import asyncio

import pytest

from kvserve.cluster.capacity_source import FALLBACK, resolve_capacity, settings_from_args


def _args(*argv: str) -> argparse.Namespace:
    """The real `kvserve cluster serve` parser."""
    from kvserve.cluster.cli import register
    parser = argparse.ArgumentParser(prog="kvserve")
    register(parser.add_subparsers(dest="command"))
    return parser.parse_args(["cluster", "serve", *argv])


def test_defaults_keep_a_fixed_fleet():
    args = _args()
    assert args.autoscale == "off" and settings_from_args(args, "default") is None


def test_cold_tier_scales_to_zero_with_the_given_capacity():
    s = settings_from_args(_args("--autoscale", "tokens", "--tier", "cold", "--replicas", "3",
                                 "--replica-capacity", "1000:50"), "default")
    assert (s.mode, s.tier, s.min_replicas, s.max_replicas) == ("tokens", "cold", 0, 3)
    assert (s.prefill_tokens_per_s, s.decode_tokens_per_s) == (1000.0, 50.0)
    assert "given" in s.capacity_source
    hot = settings_from_args(_args("--autoscale", "requests", "--max-replicas", "4"), "default")
    assert (hot.min_replicas, hot.max_replicas, hot.mode) == (1, 4, "requests")
    with pytest.raises(SystemExit):
        _args("--replica-capacity", "fast")


def test_no_local_profile_falls_back_and_says_so(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))          # no ~/.cache/kvserve/hardware/local.json here
    capacity = resolve_capacity("default", _args("--autoscale", "tokens"))
    assert (capacity.prefill_tokens_per_s, capacity.decode_tokens_per_s) == (FALLBACK.prefill_tokens_per_s,
                                                                            FALLBACK.decode_tokens_per_s)
    assert "fallback" in capacity.arithmetic and "kvserve profile" in capacity.arithmetic


def test_a_hardware_entry_gives_the_planners_capacity():
    from kvserve.planner.model_io import default_gguf_path
    if default_gguf_path() is None:
        pytest.skip("the default model package is not installed")
    capacity = resolve_capacity("default", _args("--autoscale", "tokens", "--capacity-gpu", "h100-sxm"))
    assert "on h100-sxm" in capacity.arithmetic and capacity.decode_tokens_per_s > FALLBACK.decode_tokens_per_s
    slower = resolve_capacity("default", _args("--autoscale", "tokens", "--capacity-gpu", "l4"))
    assert slower.decode_tokens_per_s < capacity.decode_tokens_per_s


class _Stream:
    """Stands in for Ray's DeploymentResponseGenerator: the head comes after ``head_after_s``."""

    def __init__(self, head_after_s: float):
        self.head_after_s, self.cancelled = head_after_s, False

    async def __anext__(self):
        await asyncio.sleep(self.head_after_s)
        return {"status": 200}

    def cancel(self):
        self.cancelled = True


def test_an_unrouted_request_gets_a_503_with_retry_after():
    from kvserve.cluster.assign_wait import NotRouted, first_item, not_routed_response
    stream = _Stream(head_after_s=60)
    with pytest.raises(NotRouted) as caught:
        asyncio.run(first_item(stream, {}, wait_s=0.3))
    assert stream.cancelled
    response = not_routed_response(caught.value, "fleet")
    assert response.status_code == 503 and response.headers["retry-after"] == "1"
    assert b"no_replica_available" in response.body


def test_a_routed_request_waits_for_its_answer_past_the_bound():
    from kvserve.cluster.assign_wait import first_item
    route = {"decision": {"replica": "a"}}              # the router took it: a long answer is no cold start
    assert asyncio.run(first_item(_Stream(head_after_s=0.5), route, wait_s=0.1)) == {"status": 200}
    assert asyncio.run(first_item(_Stream(head_after_s=0.05), {}, wait_s=None)) == {"status": 200}
