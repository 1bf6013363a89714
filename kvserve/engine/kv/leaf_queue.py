"""The prefix cache's eviction order: its leaves by last use, without a scan of the tree.

Eviction takes the least recently used leaf that no running request locks and whose grace
time has ended. ``LeafQueue`` keeps that order in heaps of entries ``(last_access, serial,
push, node)`` (``push``: a unique counter, so two entries of one node never compare nodes):

- ``lru``: every leaf, pushed when it is made or touched (``push``). An entry whose node was
  touched again, grew a child or was removed since is *stale* and skipped when it comes up
  (``is_live``); a locked leaf's entry is dropped when it comes up, since its unlock pushes it.
- ``graced``: leaves found within their grace time, kept apart so that a pass that honours
  grace does not pop them again on every call (a pool full of graced chains made each
  eviction pop every leaf). ``grace_ends`` holds the same entries by the end of their grace:
  ``release_ended(now)`` moves those whose grace has ended back to ``lru``. A pass that takes
  graced blocks too pops the older of the two heaps' heads (``pop_oldest(with_graced=True)``).

The heaps hold stale entries until they come up; when they outnumber twice the leaves, both are
rebuilt from the leaf set (``push`` does it), so memory stays bounded and each call costs
O(entries popped x log leaves).
"""
from __future__ import annotations

import heapq
import itertools
from typing import Iterable

Entry = tuple  # (last_access, serial, push, node)


class LeafQueue:
    """The leaves of a prefix cache's tree in eviction order (module docstring)."""

    def __init__(self):
        self.lru: list[Entry] = []
        self.graced: list[Entry] = []
        self.grace_ends: list[tuple[float, int, Entry]] = []
        self._pushes = itertools.count()

    @staticmethod
    def is_live(entry: Entry) -> bool:
        """The entry's node is a leaf still in the tree, not touched since the entry was made."""
        access, _, _, node = entry
        return node.last_access == access and not node.children and bool(node.block_ids)

    def push(self, node, leaves: set) -> None:
        """Queue the leaf ``node`` at its last use; rebuild from ``leaves`` (the tree's leaf set)
        when stale entries outnumber the leaves."""
        heapq.heappush(self.lru, (node.last_access, node.serial, next(self._pushes), node))
        if len(self.lru) + len(self.graced) > 2 * len(leaves) + 64:
            self.lru = [(n.last_access, n.serial, next(self._pushes), n) for n in leaves]
            heapq.heapify(self.lru)
            self.graced, self.grace_ends = [], []

    def requeue(self, entries: Iterable[Entry]) -> None:
        """Put back live entries a pass passed over (another namespace, a leaf trimmed in part)."""
        for entry in entries:
            heapq.heappush(self.lru, entry)

    def hold_in_grace(self, entry: Entry) -> None:
        """Keep a live entry whose node is within its grace time apart until the grace ends."""
        heapq.heappush(self.graced, entry)
        heapq.heappush(self.grace_ends, (entry[3].protected_until, entry[2], entry))

    def release_ended(self, now: float) -> None:
        """Move the held entries whose grace ended by ``now`` back to ``lru``."""
        ends = self.grace_ends
        while ends and ends[0][0] <= now:
            heapq.heappush(self.lru, heapq.heappop(ends)[2])

    def pop_oldest(self, with_graced: bool) -> Entry | None:
        """The oldest entry of ``lru`` (and of ``graced`` too if ``with_graced``); None when empty.
        An entry released from grace stays in ``graced`` as well: a duplicate, skipped once its
        node is gone."""
        lru, graced = self.lru, self.graced
        if with_graced and graced and (not lru or graced[0] < lru[0]):
            return heapq.heappop(graced)
        return heapq.heappop(lru) if lru else None

    def queued_ids(self) -> set[int]:
        """``id`` of every node with a live entry (for the cache's integrity check)."""
        return {id(e[3]) for e in itertools.chain(self.lru, self.graced) if self.is_live(e)}
