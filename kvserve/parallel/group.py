"""The ranks of one replica: a torch.distributed process group on 127.0.0.1.

Each ``RankGroup`` builds its own process-group object over its own rendezvous store (a
file: no listening socket), so an engine process may hold several in turn and nothing
process-global is set (no ``init_process_group``). Gloo's sockets are bound to 127.0.0.1.
CPU ranks all-reduce and all-gather small tensors through shared memory (``shm.py``).
Collectives record their wall time in ``comm_seconds`` so a benchmark can state the
all-reduce share of a step, and the shared-memory ones the ranks' arrivals (``skew``: how
much of that time was waiting for the last rank, ``skew.py``).
"""
from __future__ import annotations

import datetime
import os
import pickle
import tempfile
import time

import torch
import torch.distributed as dist

from kvserve.parallel.shm import ShmCollectives
from kvserve.parallel.skew import ArrivalSkew

LOOPBACK = "127.0.0.1"


def open_store(world_size: int, timeout_s: float = 120.0) -> tuple[dist.FileStore, str]:
    """Rank 0's rendezvous store and its path: a file in the temp folder, not a socket —
    torch's TCP store server listens on every interface whatever host it is given."""
    fd, path = tempfile.mkstemp(prefix="kvserve-ranks-")
    os.close(fd)
    os.unlink(path)                     # the store creates it; the last rank to leave removes it
    store = dist.FileStore(path, world_size)
    store.set_timeout(datetime.timedelta(seconds=timeout_s))
    return store, path


def join_store(world_size: int, path: str, timeout_s: float = 120.0) -> dist.FileStore:
    """A worker's handle on rank 0's store file."""
    store = dist.FileStore(path, world_size)
    store.set_timeout(datetime.timedelta(seconds=timeout_s))
    return store


def _process_group(store, rank: int, world_size: int, device_type: str, timeout_s: float):
    timeout = datetime.timedelta(seconds=timeout_s)
    if device_type == "cuda":
        return dist.ProcessGroupNCCL(store, rank, world_size, timeout=timeout)
    opts = dist.ProcessGroupGloo._Options()
    opts._devices = [dist.ProcessGroupGloo.create_device(hostname=LOOPBACK)]
    opts._timeout = timeout
    return dist.ProcessGroupGloo(store, rank, world_size, opts)


class RankGroup:
    """Collectives among the ``world_size`` ranks of one replica; ``rank`` 0 leads."""

    def __init__(self, store, rank: int, world_size: int, device_type: str = "cpu",
                 timeout_s: float = 24 * 3600.0, shm_slot_bytes: int = 16 * 2**20):
        self.rank, self.world_size, self.device_type = rank, world_size, device_type
        self.store = store
        # a worker waits for rank 0's next command for as long as the engine idles; commands
        # (pickled objects) always travel over gloo, tensors over the device's backend
        self._pg = _process_group(dist.PrefixStore("data/", store), rank, world_size, device_type, timeout_s)
        self._control = (self._pg if device_type != "cuda" else
                         _process_group(dist.PrefixStore("control/", store), rank, world_size, "cpu", timeout_s))
        self.comm_seconds = 0.0           # wall time inside collectives, since creation
        self.comm_calls = 0
        self.skew = ArrivalSkew()         # shared-memory calls: waits for the last rank (skew.py)
        self._after_command = False
        self._shm = self._map_shared_memory(shm_slot_bytes) if device_type == "cpu" and shm_slot_bytes else None

    def _map_shared_memory(self, slot_bytes: int) -> ShmCollectives | None:
        """CPU ranks (one host): rank 0 creates the shared mapping, every rank maps it, then
        rank 0 removes its name (the mapping stays until the last rank leaves)."""
        if self.world_size == 1:
            return None
        if self.rank == 0:
            path = ShmCollectives.new_path()
            shm = ShmCollectives(path, 0, self.world_size, slot_bytes, create=True)
            self.store.set("shm_path", path)
        else:
            path = self.store.get("shm_path").decode()
            shm = ShmCollectives(path, self.rank, self.world_size, slot_bytes, create=False)
        self._pg.allreduce([torch.zeros(1)]).wait()          # every rank has mapped it
        if self.rank == 0:
            os.unlink(path)
        return shm

    @property
    def uses_shared_memory(self) -> bool:
        """Whether small CPU collectives go through shared memory (else the process group)."""
        return self._shm is not None

    def _timed(self, work) -> None:
        started = time.perf_counter()
        work.wait()
        self.comm_seconds += time.perf_counter() - started
        self.comm_calls += 1

    def _timed_call(self, collective, *args):
        """A shared-memory collective: timed, and its ranks' arrivals added to ``skew``."""
        started = time.perf_counter()
        result = collective(*args)
        self.comm_seconds += time.perf_counter() - started
        self.comm_calls += 1
        self.skew.record(self._shm.arrivals(), self.rank, self._after_command)
        self._after_command = False
        return result

    def all_reduce_(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum ``tensor`` over the ranks, in place; returns it."""
        if self.world_size > 1:
            if self._shm is not None and self._shm.fits(tensor):
                self._timed_call(self._shm.all_reduce_, tensor)
            else:
                self._timed(self._pg.allreduce([tensor]))
        return tensor

    def all_gather(self, tensor: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """The ranks' equally shaped ``tensor`` concatenated along ``dim`` in rank order."""
        if self.world_size == 1:
            return tensor
        tensor = tensor.contiguous()
        if self._shm is not None and self._shm.fits(tensor):
            return self._timed_call(self._shm.all_gather, tensor, dim)
        parts = [torch.empty_like(tensor) for _ in range(self.world_size)]
        self._timed(self._pg.allgather([parts], [tensor]))
        return torch.cat(parts, dim=dim)

    def all_to_all(self, tensor: torch.Tensor, send_rows: list[int], recv_rows: list[int],
                   max_rows: int | None = None) -> torch.Tensor:
        """Rows ``tensor[sum(send_rows[:r]):...]`` go to rank r; returns the rows received,
        ``recv_rows[r]`` from each rank r, in rank order. ``max_rows``: a bound on the rows any
        rank sends, the same on every rank; with it, CPU ranks exchange through shared memory
        when the bound fits a slot (else, and without it, through the process group)."""
        if self.world_size > 1 and self._shm is not None and max_rows is not None \
                and self._shm.fits_rows(max_rows, tensor):
            return self._timed_call(self._shm.all_to_all, tensor, list(send_rows))
        out = tensor.new_empty((sum(recv_rows),) + tuple(tensor.shape[1:]))
        self._timed(self._pg.alltoall_base(out, tensor.contiguous(), list(recv_rows), list(send_rows)))
        return out

    def broadcast_object(self, obj=None):
        """Rank 0's ``obj`` on every rank (pickled once): through shared memory where the ranks
        have it and the bytes fit a slot, else over gloo (a length, then the bytes)."""
        self._after_command = True
        payload = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL) if self.rank == 0 else None
        if self._shm is not None:
            data = self._shm.broadcast_bytes(payload)
            if data is not None:
                return obj if self.rank == 0 else pickle.loads(data)
        if self.rank == 0:
            data = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
            size = torch.tensor([data.numel()], dtype=torch.int64)
        else:
            size = torch.zeros(1, dtype=torch.int64)
        self._broadcast(size)
        if self.rank != 0:
            data = torch.empty(int(size.item()), dtype=torch.uint8)
        self._broadcast(data)
        return obj if self.rank == 0 else pickle.loads(data.numpy().tobytes())

    def _broadcast(self, tensor: torch.Tensor) -> None:
        opts = dist.BroadcastOptions()
        opts.rootRank = 0
        self._control.broadcast([tensor], opts).wait()
