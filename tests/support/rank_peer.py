"""Rank 1 of a two-rank ``RankGroup`` for tests (a spawned process runs ``peer``)."""
from __future__ import annotations

import torch


def loopback_listeners() -> list[str]:
    """Addresses this process listens on (TCP)."""
    import psutil
    return sorted({c.laddr.ip for c in psutil.Process().net_connections(kind="tcp") if c.status == "LISTEN"})


def peer(path: str, results) -> None:
    """Join rank 0's store as rank 1, run each collective once, report what it saw."""
    from kvserve.parallel.group import RankGroup, join_store
    group = RankGroup(join_store(2, path), 1, 2)
    reduced = group.all_reduce_(torch.tensor([10.0, 20.0]))
    gathered = group.all_gather(torch.tensor([[3.0]]), dim=-1)
    exchanged = group.all_to_all(torch.tensor([[10.0], [11.0], [12.0]]), send_rows=[1, 2], recv_rows=[1, 2])
    via_shm = group.all_to_all(torch.tensor([[13.0, 13.5]]), send_rows=[0, 1], recv_rows=[2, 1], max_rows=4)
    received = group.broadcast_object()
    big = group.all_reduce_(torch.full((5 * 2**20,), 2.0))          # 20 MiB: over a slot, through gloo
    results.put({"big": float(big[0]), "shm": group.uses_shared_memory, "reduced": reduced.tolist(), "gathered": gathered.tolist(), "exchanged": exchanged.tolist(), "via_shm": via_shm.tolist(),
                 "received": received, "listeners": loopback_listeners()})
