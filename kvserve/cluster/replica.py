"""``EngineReplica``: one Ray Serve replica = one kvserve server (its HTTP front end in this
actor, its engine in a child process), serving the requests the ingress forwards, and
reporting what the router needs (``record_routing_stats``)."""
from __future__ import annotations

import argparse
import logging
import time
from typing import AsyncIterator

from kvserve.cluster.asgi_bridge import exchange
from kvserve.cluster.keepalive import is_keepalive, with_keepalives

logger = logging.getLogger("kvserve.cluster")


class ReplicaUnavailable(RuntimeError):
    """This replica cannot serve (its engine died); Ray Serve restarts it after a health check."""

    def __init__(self, replica_id: str):
        super().__init__(f"replica {replica_id}: the engine process is not running")
        self.replica_id = replica_id


class EngineReplica:
    """Built by Ray Serve with the ``kvserve serve`` arguments (an argparse Namespace)."""

    async def __init__(self, serve_args: argparse.Namespace):
        from kvserve.cluster.ray_runtime import pin_replica_grpc_to_loopback
        from kvserve.server.app import build_app
        from kvserve.server.cli import build_server
        pin_replica_grpc_to_loopback()
        self.server = build_server(serve_args)
        self.app = build_app(self.server.ctx)
        self.max_num_seqs = serve_args.max_num_seqs
        await self.server.start_engine()
        if not self.server.ctx.state.engine_ready:
            raise RuntimeError(f"the engine did not start: {self.server.ctx.state.startup_error}")
        self.replica_id = _replica_id()
        logger.info("replica %s ready", self.replica_id)

    async def handle(self, method: str, path: str, query: str, headers: list[tuple[str, str]], body: bytes,
                     route: dict | None = None) -> AsyncIterator:
        """One HTTP exchange through this replica's app: ``{"status", "headers", "replica"}``
        first, then body chunks, with keep-alives before and between them while the app is
        silent (``keepalive.py``). ``route`` is what the router read; the replica ignores it."""
        if self.server.ctx.state.engine_dead:        # fail before the first byte: the ingress retries elsewhere
            raise ReplicaUnavailable(self.replica_id)
        first = True
        async for item in with_keepalives(exchange(self.app, method, path, query, headers, body)):
            if first and not is_keepalive(item):
                item["replica"] = self.replica_id
                first = False
            yield item

    def record_routing_stats(self) -> dict:
        """Load, KV use and the cached blocks' hashes, for ``KVServeRequestRouter``."""
        client = self.server.ctx.client
        if client is None:
            return {}
        live = [r for r in client.requests.values() if r.finish_time is None]
        stats = client.stats
        info = client.info
        return {"healthy": not self.server.ctx.state.engine_dead,
                "num_running": sum(r.started for r in live), "num_waiting": sum(not r.started for r in live),
                "queued_tokens": client.num_queued_uncached_tokens,
                "kv_usage": stats.kv_blocks_used / stats.kv_blocks_total if stats.kv_blocks_total else 0.0,
                "max_num_seqs": self.max_num_seqs, "block_size": info.block_size if info else 16,
                "blocks": sorted(client.cached_blocks), "adapters": list(stats.adapters.resident_ids),
                "adapter_ids": {name: a.get("id", name) for name, a in client.adapters.items()}, "time": time.time()}

    def record_autoscaling_stats(self) -> dict:
        """This replica's token counters and request gauges, as its ``/metrics`` shows them, for
        ``KVServeAutoscalingPolicy`` (Ray Serve records them while autoscaling is on)."""
        from kvserve.cluster.autoscaling import replica_autoscaling_stats
        if self.server.ctx.client is not None:
            self.server.ctx.client.refresh_queue_gauges()
        return replica_autoscaling_stats(self.server.ctx.metrics)

    def check_health(self) -> None:
        """Ray Serve restarts a replica whose engine died."""
        state = self.server.ctx.state
        if state.engine_dead:
            raise RuntimeError("the engine process died")

    async def __del__(self):
        client = self.server.ctx.client if hasattr(self, "server") else None
        if client is not None:
            await client.shutdown()


def _replica_id() -> str:
    from ray import serve
    return serve.get_replica_context().replica_id.unique_id
