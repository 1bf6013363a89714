"""Capacity planner: pure memory / bandwidth / fleet arithmetic (see docs/planner.md).

``kv_bytes_per_token`` and ``kv_cache_plan`` are also the engine's KV sizing functions.
Entry points: ``make_plan(PlanInputs(...))`` and the ``kvserve plan`` / ``kvserve profile`` CLI.
"""
from kvserve.planner.kv_memory import KVCachePlan, kv_bytes_per_token, kv_cache_plan

__all__ = ["KVCachePlan", "kv_bytes_per_token", "kv_cache_plan", "make_plan", "PlanInputs", "PlanOptions"]


def __getattr__(name: str):
    # Lazy so the engine's import of the KV functions stays light.
    if name == "make_plan":
        from kvserve.planner.plan import make_plan
        return make_plan
    if name in ("PlanInputs", "PlanOptions"):
        from kvserve.planner import candidates
        return getattr(candidates, name)
    raise AttributeError(name)
