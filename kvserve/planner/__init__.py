"""Capacity planner: pure memory / bandwidth / fleet arithmetic (see docs/planner.md)."""
from kvserve.planner.kv_memory import kv_bytes_per_token, kv_cache_plan, KVCachePlan

__all__ = ["kv_bytes_per_token", "kv_cache_plan", "KVCachePlan"]
