"""Collectives through shared memory for CPU ranks on one host.

Gloo moves a tensor between two processes on one host over TCP loopback: ~0.1-0.9 ms for the
``[T, hidden]`` all-reduce a decode step runs twice per layer (measured on this machine's
2 cores), which is a third of a tensor-parallel decode step. Here every rank owns two slots
(even and odd calls) in one shared mapping of a file in ``/dev/shm`` and one counter:

    call g: copy my tensor into my slot (g mod 2); counter[me] = g;
            wait until every counter >= g; result = slot[0] + slot[1] + ... (rank order)

Every rank sums the same slots in the same order, so the result is bitwise the same on all
ranks (as the residual stream requires). A slot of call ``g`` is written again at call
``g + 2``, which no rank reaches before every rank has passed call ``g + 1``'s wait — that is,
has finished reading call ``g``'s slots — so two slots per rank suffice. x86's stores are seen
in program order (the data before its counter).

An all-to-all (expert parallelism's dispatch and combine) publishes the same way: the slot
holds the sender's rows per destination (``world_size`` int64s), then its rows, destination-
major; each rank reads, from every slot, the rows addressed to it (their offset is the sum of
the rows the sender addressed to lower ranks).

Each rank also stamps its arrival (``time.perf_counter_ns``: CLOCK_MONOTONIC, one clock for
every process of the host) in its counter's cache line, one stamp per slot parity, so after a
call every rank reads when each rank arrived (``arrivals``): the time a rank spends waiting
for the last one is the ranks' skew, not the wire.

Rank 0's commands to the other ranks travel the same way (``broadcast_bytes``: the pickled
command in rank 0's slot; ~0.1 ms where gloo's two broadcasts over loopback TCP take ~0.7
ms), and a worker waiting for the next one naps between polls once it has waited a few
milliseconds, so an idle replica's workers do not hold their cores.

Each rank writes its pid in its counter's line too: a wait notices within milliseconds that a
rank which has not arrived has no live process (it died) and raises; a rank that is alive but
never arrives makes a collective's wait raise after ``timeout_s``. Larger tensors than a slot fall back to the process group's own collective.
"""
from __future__ import annotations

import math
import os
import tempfile
import time

import torch

COUNTER_BYTES = 64          # one cache line per rank's counter
BUSY_SPINS = 32             # polls before each further poll yields the core
PATIENT_SPIN_S = 0.005      # a patient wait (a command's: workers idle there) yields this long ...
PATIENT_NAP_S = 0.0002      # ... then naps this long between polls


class ShmCollectives:
    """All-reduce, all-gather and all-to-all of float tensors through one shared ``/dev/shm`` mapping."""

    def __init__(self, path: str, rank: int, world_size: int, slot_bytes: int, create: bool,
                 timeout_s: float = 120.0):
        self.rank, self.world_size, self.slot_bytes, self.timeout_s = rank, world_size, slot_bytes, timeout_s
        total = world_size * (COUNTER_BYTES + 2 * slot_bytes)
        if create:
            with open(path, "wb") as f:
                f.truncate(total)
        self._memory = torch.from_file(path, shared=True, size=total, dtype=torch.uint8)
        lines = self._memory[:world_size * COUNTER_BYTES].view(torch.int64).view(world_size, -1)
        self._counters = lines[:, 0]
        self._stamps = lines[:, 1:3].numpy()          # arrival ns per (rank, call parity); numpy: cheap stores
        self._pids = lines[:, 3].numpy()              # each rank's process, to tell a late rank from a dead one
        self._pids[rank] = os.getpid()
        self._slots = self._memory[world_size * COUNTER_BYTES:].view(world_size, 2, slot_bytes)
        self._call = 0

    @staticmethod
    def new_path() -> str:
        """A fresh file name for the mapping (in ``/dev/shm`` when there is one)."""
        folder = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
        fd, path = tempfile.mkstemp(prefix="kvserve-ranks-shm-", dir=folder)
        os.close(fd)
        return path

    def fits(self, tensor: torch.Tensor) -> bool:
        """Whether ``tensor`` goes through the slots (a CPU float tensor small enough)."""
        return (tensor.device.type == "cpu" and tensor.is_floating_point()
                and tensor.numel() * tensor.element_size() <= self.slot_bytes)

    def _slot(self, rank: int, tensor: torch.Tensor) -> torch.Tensor:
        nbytes = tensor.numel() * tensor.element_size()
        return self._slots[rank, self._call & 1, :nbytes].view(tensor.dtype).view(tensor.shape)

    def fits_rows(self, max_rows: int, tensor: torch.Tensor) -> bool:
        """Whether an all-to-all whose senders each send at most ``max_rows`` rows shaped like
        ``tensor``'s goes through the slots (every rank must decide the same: ``max_rows`` is a
        bound all ranks share, not a rank's own count)."""
        row_bytes = math.prod(tensor.shape[1:]) * tensor.element_size()
        return (tensor.device.type == "cpu" and tensor.is_floating_point()
                and 8 * self.world_size + max_rows * row_bytes <= self.slot_bytes)

    def _publish_and_wait(self, tensor: torch.Tensor) -> None:
        self._call += 1
        self._slot(self.rank, tensor).copy_(tensor)
        self._arrive_and_wait()

    def _arrive_and_wait(self, patient: bool = False) -> None:
        """Count this rank in for call ``self._call`` (its slot written, its arrival stamped),
        then wait for every rank: spin, then yield the core, and past ``timeout_s`` raise —
        or, ``patient`` (a command's wait: a worker idles there as long as the engine does),
        sleep in short naps once the wait is past ``PATIENT_SPIN_S`` and never time out. Either
        raises when a rank that has not arrived has no live process."""
        self._stamps[self.rank, self._call & 1] = time.perf_counter_ns()
        self._counters[self.rank] = self._call
        deadline, spins, napping = None, 0, False
        while int(self._counters.min()) < self._call:
            spins += 1
            if spins < BUSY_SPINS:
                continue
            if napping:
                time.sleep(PATIENT_NAP_S)
                continue
            os.sched_yield()           # more ranks than free cores: let the late one run
            if spins % 1024 == 0:
                self._raise_if_a_rank_died()
                now = time.monotonic()
                deadline = deadline or now + (PATIENT_SPIN_S if patient else self.timeout_s)
                if now > deadline:
                    if not patient:
                        raise RuntimeError(f"shared-memory collective: a rank did not arrive within {self.timeout_s} s")
                    napping = True

    def _raise_if_a_rank_died(self) -> None:
        """Raise if a rank that has not arrived has no live process (gone, or a zombie not yet
        reaped): its collective would never complete."""
        for rank in range(self.world_size):
            pid = int(self._pids[rank])
            if rank != self.rank and pid > 0 and int(self._counters[rank]) < self._call and not _alive(pid):
                raise RuntimeError(f"shared-memory collective: rank {rank} (pid {pid}) is gone; "
                                   f"connection to the rank lost")

    def broadcast_bytes(self, payload: bytes | None) -> bytes | None:
        """Rank 0's ``payload`` on every rank (the others pass None), through rank 0's slot; None
        on every rank when it does not fit a slot (the caller then sends it another way).
        Every rank waits patiently: the workers wait here for rank 0's next command as long as
        the engine idles, and rank 0 for workers still loading their shards at start-up; a rank
        whose process is gone still ends the wait."""
        self._call += 1
        slot = self._slots[0, self._call & 1]
        if self.rank == 0:
            size = len(payload) if 8 + len(payload) <= self.slot_bytes else -1
            slot[:8].view(torch.int64)[0] = size
            if size > 0:
                slot[8:8 + size].copy_(torch.frombuffer(bytearray(payload), dtype=torch.uint8))
        self._arrive_and_wait(patient=True)
        size = int(slot[:8].view(torch.int64)[0])
        if size < 0:
            return None
        return payload if self.rank == 0 else slot[8:8 + size].numpy().tobytes()

    def arrivals(self) -> list[float]:
        """Each rank's arrival at the last call (``time.perf_counter`` seconds), in rank order.
        Valid until this rank's next call: no rank stamps call ``g + 2``'s parity before every
        rank has passed call ``g + 1``'s wait."""
        return [float(ns) * 1e-9 for ns in self._stamps[:, self._call & 1]]

    def all_reduce_(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum ``tensor`` over the ranks in place (rank order: the same bits everywhere)."""
        self._publish_and_wait(tensor.contiguous())
        tensor.copy_(self._slot(0, tensor))
        for rank in range(1, self.world_size):
            tensor.add_(self._slot(rank, tensor))
        return tensor

    def all_to_all(self, tensor: torch.Tensor, send_rows: list[int]) -> torch.Tensor:
        """Rows ``tensor[sum(send_rows[:r]):...]`` go to rank r; returns the rows addressed to
        this rank by each rank, in rank order (a new tensor)."""
        tensor, head = tensor.contiguous(), 8 * self.world_size
        shape, row = tuple(tensor.shape[1:]), math.prod(tensor.shape[1:])
        self._call += 1
        mine = self._slots[self.rank, self._call & 1]
        mine[:head].view(torch.int64).copy_(torch.tensor(send_rows, dtype=torch.int64))
        mine[head:head + tensor.numel() * tensor.element_size()].view(tensor.dtype).copy_(tensor.view(-1))
        self._arrive_and_wait()
        parts = []
        for rank in range(self.world_size):
            slot = self._slots[rank, self._call & 1]
            rows = slot[:head].view(torch.int64).tolist()
            start, count = sum(rows[:self.rank]) * row, rows[self.rank]
            parts.append(slot[head:].view(tensor.dtype)[start:start + count * row].view((count,) + shape))
        return torch.cat(parts)

    def all_gather(self, tensor: torch.Tensor, dim: int) -> torch.Tensor:
        """The ranks' equally shaped ``tensor`` concatenated along ``dim`` in rank order."""
        tensor = tensor.contiguous()
        self._publish_and_wait(tensor)
        return torch.cat([self._slot(rank, tensor) for rank in range(self.world_size)], dim=dim)


def _alive(pid: int) -> bool:
    """Whether process ``pid`` exists and is not a zombie (Linux: its /proc state)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0] not in (b"Z", b"X")
    except FileNotFoundError:
        return False
    except OSError:                     # no /proc: signal 0 tells whether it exists
        try:
            os.kill(pid, 0)
            return True
        except ProcessLookupError:
            return False
