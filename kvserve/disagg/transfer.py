"""Moving KV blocks between engines: the ``KVTransfer`` interface and its one-host
shared-memory implementation.

A transfer moves the KV of some of a prompt's full blocks, named by their chained block
hashes (``engine/kv/cache_events.py``), from the engine that computed them (the sender,
the prefill engine) to the engine that will decode (the receiver)::

    driver                    sender (prefill)              receiver (decode)
    reserve(id, n) -> ticket
                              send(ticket, hashes, kv)
                                                            receive(ticket) -> hashes, kv
    release(ticket)

The ticket is the rendezvous: for ``SharedMemoryTransfer`` it names staging slots in one
``/dev/shm`` file that every process maps (no pickling, no socket for the tensors); a
network transport (torch.distributed send/recv between the two engines' ranks, NIXL
reads into registered memory) implements the same four calls with the ticket as the
tag / descriptor. The driver owns reservations: it releases a ticket only after every
process that may touch it has said it is done, so a slot is never reused under a writer.
"""
from __future__ import annotations

import os
import uuid
from abc import ABC, abstractmethod
from collections import deque
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class KVLayout:
    """The shape of one KV block in every layer: ``[layers, 2, block_size, KVH, D]``."""

    num_layers: int
    block_size: int
    num_kv_heads: int
    head_dim: int
    dtype: str = "float32"

    @property
    def block_bytes(self) -> int:
        """Bytes of one block, every layer's K and V."""
        element = torch.empty((), dtype=getattr(torch, self.dtype)).element_size()
        return 2 * self.num_layers * self.block_size * self.num_kv_heads * self.head_dim * element

    def to_dict(self) -> dict:
        return dict(vars(self))


@dataclass(frozen=True)
class TransferTicket:
    """A reservation for one transfer of up to ``len(slots)`` blocks."""

    transfer_id: str
    slots: tuple[int, ...]

    @property
    def num_blocks(self) -> int:
        return len(self.slots)


class KVTransfer(ABC):
    """Moves the KV of full blocks, with their hashes, from one engine to another.

    ``reserve`` / ``release`` run in the driver; ``send`` in the sending engine's
    process, ``receive`` in the receiving one's (``attach`` gives those processes their
    handle from ``describe()``). KV tensors are ``[layers, 2, n, block_size, KVH, D]``."""

    @abstractmethod
    def reserve(self, transfer_id: str, num_blocks: int) -> TransferTicket | None:
        """Room for ``num_blocks`` blocks, or None when there is not enough now (the
        caller waits for a release; never raises for lack of room)."""

    @abstractmethod
    def release(self, ticket: TransferTicket) -> None:
        """Return the ticket's room; no process may touch it afterwards."""

    @abstractmethod
    def send(self, ticket: TransferTicket, block_hashes: list[int], kv: torch.Tensor) -> None:
        """Deliver ``len(block_hashes)`` (<= ticket.num_blocks) blocks and their hashes."""

    @abstractmethod
    def receive(self, ticket: TransferTicket, num_blocks: int) -> tuple[list[int], torch.Tensor]:
        """The first ``num_blocks`` blocks sent on the ticket: their hashes and KV."""

    @abstractmethod
    def describe(self) -> dict:
        """Plain data from which another process attaches to this transport."""

    @property
    @abstractmethod
    def num_free_blocks(self) -> int:
        """Blocks that can be reserved now."""


class SlotAllocator:
    """A free list of ``num_slots`` staging slots. Pure Python."""

    def __init__(self, num_slots: int):
        if num_slots <= 0:
            raise ValueError("num_slots must be positive")
        self.num_slots = num_slots
        self._free = deque(range(num_slots))
        self._held: dict[str, tuple[int, ...]] = {}

    @property
    def num_free(self) -> int:
        return len(self._free)

    def take(self, owner: str, count: int) -> tuple[int, ...] | None:
        """``count`` slots for ``owner`` (one reservation per owner), or None if too few."""
        if owner in self._held:
            raise RuntimeError(f"{owner} already holds staging slots")
        if count > len(self._free) or count <= 0:
            return None
        slots = tuple(self._free.popleft() for _ in range(count))
        self._held[owner] = slots
        return slots

    def give(self, owner: str) -> None:
        """Return ``owner``'s slots (a second give is a bug)."""
        slots = self._held.pop(owner, None)
        if slots is None:
            raise RuntimeError(f"{owner} holds no staging slots")
        self._free.extend(slots)

    def check_integrity(self) -> None:
        """Every slot free or held by exactly one owner."""
        held = [s for slots in self._held.values() for s in slots]
        if sorted([*self._free, *held]) != list(range(self.num_slots)):
            raise AssertionError("staging slots lost or held twice")

    @property
    def owners(self) -> list[str]:
        return sorted(self._held)


class SharedMemoryTransfer(KVTransfer):
    """Staging slots in one file under ``/dev/shm`` that the driver and both engines map
    (``torch.from_file(shared=True)``): ``send`` copies blocks into the ticket's slots,
    ``receive`` copies them out. One host only. The creator removes the file on
    ``close``; attached processes only unmap it."""

    def __init__(self, layout: KVLayout, num_slots: int, path: str | None = None, create: bool = True):
        self.layout, self.num_slots = layout, num_slots
        self.path = path or f"/dev/shm/kvserve-kv-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self._owner = create
        shape = (num_slots, layout.num_layers, 2, layout.block_size, layout.num_kv_heads, layout.head_dim)
        numel = num_slots * layout.num_layers * 2 * layout.block_size * layout.num_kv_heads * layout.head_dim
        if create:
            with open(self.path, "wb") as f:
                f.truncate(numel * torch.empty((), dtype=getattr(torch, layout.dtype)).element_size() + 8 * num_slots)
        dtype = getattr(torch, layout.dtype)
        if numel * torch.empty((), dtype=dtype).element_size() % 8:
            raise ValueError("the staging KV area must be a whole number of 8-byte words")
        self._kv = torch.from_file(self.path, shared=True, size=numel, dtype=dtype).view(shape)
        hashes = torch.from_file(self.path, shared=True, size=numel * self._kv.element_size() // 8 + num_slots,
                                 dtype=torch.int64)
        self._hashes = hashes[numel * self._kv.element_size() // 8:]      # one int64 per slot
        self._slots = SlotAllocator(num_slots) if create else None

    @classmethod
    def attach(cls, description: dict) -> "SharedMemoryTransfer":
        """The same staging area in another process (from ``describe()``)."""
        return cls(KVLayout(**description["layout"]), description["num_slots"], description["path"], create=False)

    def describe(self) -> dict:
        return {"kind": "shm", "path": self.path, "num_slots": self.num_slots, "layout": self.layout.to_dict()}

    # ------------------------------------------------------------ driver side
    def reserve(self, transfer_id: str, num_blocks: int) -> TransferTicket | None:
        slots = self._allocator().take(transfer_id, num_blocks)
        return TransferTicket(transfer_id, slots) if slots is not None else None

    def release(self, ticket: TransferTicket) -> None:
        self._allocator().give(ticket.transfer_id)

    @property
    def num_free_blocks(self) -> int:
        return self._allocator().num_free

    def check_integrity(self) -> None:
        """Every staging slot free or held by one live reservation."""
        self._allocator().check_integrity()

    @property
    def reserved(self) -> list[str]:
        """Transfer ids holding slots now."""
        return self._allocator().owners

    def _allocator(self) -> SlotAllocator:
        if self._slots is None:
            raise RuntimeError("only the process that created the staging area reserves slots")
        return self._slots

    # ------------------------------------------------------------ engine side
    def send(self, ticket: TransferTicket, block_hashes: list[int], kv: torch.Tensor) -> None:
        num = len(block_hashes)
        if num > ticket.num_blocks or kv.shape[2] != num:
            raise ValueError(f"{num} blocks ({kv.shape[2]} in kv) for a ticket of {ticket.num_blocks}")
        if num == 0:
            return
        index = torch.tensor(ticket.slots[:num], dtype=torch.long)
        # kv [layers, 2, n, bs, KVH, D] -> slots [n, layers, 2, bs, KVH, D]
        self._kv.index_copy_(0, index, kv.to(device="cpu", dtype=self._kv.dtype).permute(2, 0, 1, 3, 4, 5))
        self._hashes.index_copy_(0, index, torch.tensor(block_hashes, dtype=torch.int64))

    def receive(self, ticket: TransferTicket, num_blocks: int) -> tuple[list[int], torch.Tensor]:
        if num_blocks > ticket.num_blocks:
            raise ValueError(f"{num_blocks} blocks from a ticket of {ticket.num_blocks}")
        index = torch.tensor(ticket.slots[:num_blocks], dtype=torch.long)
        kv = self._kv.index_select(0, index).permute(1, 2, 0, 3, 4, 5)     # [layers, 2, n, bs, KVH, D]
        return self._hashes.index_select(0, index).tolist(), kv

    def unlink(self) -> None:
        """Remove the file now that every process has mapped it (the mappings stay valid),
        so nothing is left in /dev/shm even if a process dies without ``close``."""
        if self._owner and os.path.exists(self.path):
            os.unlink(self.path)

    def close(self) -> None:
        """Unmap; the creator also removes the file."""
        self._kv = self._hashes = None
        if self._owner and os.path.exists(self.path):
            os.unlink(self.path)


def attach_transfer(description: dict) -> KVTransfer:
    """The transport another process described (``KVTransfer.describe()``)."""
    if description.get("kind") == "shm":
        return SharedMemoryTransfer.attach(description)
    raise ValueError(f"unknown KV transfer kind {description.get('kind')!r}")
