"""Which KV blocks each replica holds, as block hashes the engine's prefix cache uses.

A request's blocks are hashed exactly as the engine hashes them
(``kvserve/engine/kv/cache_events.py``: a chain from the namespace's seed over each full
block's token ids), so a replica's cached prefix of the request is the run of leading
hashes found in its set. The sets are fed by the replicas' ``BlockStored`` /
``BlockRemoved`` events (exact: the "precise" scorer) or by the router's own record of
where it sent what (approximate, bounded per replica). Predictions (``predict``) are
blocks a replica will hold once it computes a request just sent to it: they count as
held until they expire, whatever the replica reports meanwhile.
"""
from __future__ import annotations

from collections import deque
from typing import Iterable, Sequence

from kvserve.engine.kv.cache_events import BlockRemoved, BlockStored, CacheEvent, CacheNamespace, block_hash, \
    namespace_seed


def request_block_hashes(token_ids: Sequence[int], namespace: CacheNamespace, block_size: int) -> list[int]:
    """The hashes of the request's full blocks, first block first (a partial last block has none)."""
    hashes, parent = [], namespace_seed(namespace)
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = block_hash(parent, list(token_ids[start:start + block_size]))
        hashes.append(parent)
    return hashes


class BlockIndex:
    """Block hashes per replica. ``max_blocks_per_replica`` bounds each replica's set (least
    recently recorded dropped first); None = unbounded (events keep it exact)."""

    def __init__(self, max_blocks_per_replica: int | None = None):
        self.max_blocks_per_replica = max_blocks_per_replica
        self._blocks: dict[str, dict[int, None]] = {}      # insertion order = recency
        self._predicted: dict[str, dict[int, float]] = {}  # replica -> block hash -> expiry time
        self._expiries: deque[tuple[float, str, tuple[int, ...]]] = deque()   # predictions, oldest first

    def apply(self, replica: str, event: CacheEvent) -> None:
        """One cache event of ``replica``'s engine."""
        if isinstance(event, BlockStored):
            self.record(replica, event.block_hashes)
        elif isinstance(event, BlockRemoved):
            blocks = self._blocks.get(replica)
            if blocks is not None:
                for h in event.block_hashes:
                    blocks.pop(h, None)

    def record(self, replica: str, hashes: Iterable[int]) -> None:
        """``replica`` holds these blocks now (refreshes their recency)."""
        blocks = self._blocks.setdefault(replica, {})
        for h in hashes:
            blocks.pop(h, None)
            blocks[h] = None
        cap = self.max_blocks_per_replica
        if cap is not None and len(blocks) > cap:
            oldest = iter(blocks)
            for h in [next(oldest) for _ in range(len(blocks) - cap)]:
                del blocks[h]

    def predict(self, replica: str, hashes: Iterable[int], until: float) -> None:
        """``replica`` will hold these blocks soon: count them as held until time ``until``."""
        predicted, hashes = self._predicted.setdefault(replica, {}), tuple(hashes)
        for h in hashes:
            predicted[h] = until
        self._expiries.append((until, replica, hashes))

    def expire_predictions(self, now: float) -> None:
        """Drop the predictions whose time has passed (the replica's reports speak for them)."""
        while self._expiries and self._expiries[0][0] <= now:
            _, replica, hashes = self._expiries.popleft()
            predicted = self._predicted[replica]
            for h in hashes:
                if predicted.get(h, now + 1) <= now:     # not predicted again since
                    del predicted[h]

    def prefix_length(self, replica: str, hashes: Sequence[int]) -> int:
        """How many of the leading ``hashes`` ``replica`` holds or is predicted to (its cached
        prefix, in blocks)."""
        blocks, predicted = self._blocks.get(replica, {}), self._predicted.get(replica, {})
        for i, h in enumerate(hashes):
            if h not in blocks and h not in predicted:
                return i
        return len(hashes)

    def forget(self, replica: str) -> None:
        """Drop what ``replica`` held (it restarted with an empty cache, or left); its
        predictions stay until they expire."""
        self._blocks.pop(replica, None)

    def num_blocks(self, replica: str) -> int:
        return len(self._blocks.get(replica, ()))
