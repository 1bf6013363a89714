"""Tier 1: the servers' test port is chosen where Ray and the kernel do not pick ports.

A port from ``bind(0)`` lies in the kernel's ephemeral range, where Ray picks its own
listeners' ports and every outgoing connection takes its local port; a Ray Serve proxy once
failed to bind one (benchmarks/server_process.py)."""
from __future__ import annotations

import random
import socket

from benchmarks.server_process import RAY_WORKER_PORT_MAX, ephemeral_port_low, free_port


def test_the_port_lies_between_rays_workers_and_the_ephemeral_range():
    rng = random.Random(0)
    for _ in range(50):
        port = free_port(rng)
        assert RAY_WORKER_PORT_MAX < port < ephemeral_port_low()
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))          # free when it is handed out


def test_a_port_in_use_is_passed_over():
    taken = free_port(random.Random(1))
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", taken))
        holder.listen()
        assert free_port(random.Random(1)) != taken    # same draw first, then the next one


def test_with_no_band_left_the_kernel_picks(monkeypatch):
    import benchmarks.server_process as server_process
    monkeypatch.setattr(server_process, "ephemeral_port_low", lambda: RAY_WORKER_PORT_MAX + 1)
    port = free_port(random.Random(2))
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))
