"""Small shared pieces of the benchmarks: the machine's description, the JSON report,
pinning this process, and reading a server's /metrics with an admin key."""
from __future__ import annotations

import json
import os
from pathlib import Path

import httpx

from kvserve.server.metrics import parse_metrics


def machine() -> dict:
    """CPU model and core count of this machine, and the CPUs this process may use."""
    model = None
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            model = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), None)
    except OSError:
        pass
    return {"cpu_model": model, "cores": os.cpu_count(), "client_affinity": sorted(os.sched_getaffinity(0))}


def emit(report: dict, out: str | None) -> None:
    """Print a benchmark's JSON report, and write it to ``out`` when given."""
    text = json.dumps(report, indent=1)
    print(text)
    if out:
        Path(out).write_text(text + "\n")


def pin_cpus(spec: str | None) -> None:
    """Pin this process to ``spec`` (``"1"``, ``"0,1"``, ``"0-3"``); nothing when empty."""
    if not spec:
        return
    cpus: list[int] = []
    for part in spec.split(","):
        lo, _, hi = part.partition("-")
        cpus.extend(range(int(lo), int(hi or lo) + 1))
    os.sched_setaffinity(0, set(cpus))


def admin_headers(admin_key: str | None) -> dict:
    return {"Authorization": f"Bearer {admin_key}"} if admin_key else {}


def scrape_sync(base_url: str, admin_key: str | None = None) -> dict[str, float]:
    """/metrics parsed ({} when it cannot be read)."""
    try:
        response = httpx.get(base_url + "/metrics", headers=admin_headers(admin_key), timeout=30)
        return parse_metrics(response.text) if response.status_code == 200 else {}
    except httpx.HTTPError:
        return {}


async def scrape(client: httpx.AsyncClient, base_url: str, admin_key: str | None = None) -> dict[str, float]:
    """/metrics parsed, with an async client ({} when it cannot be read)."""
    try:
        response = await client.get(base_url + "/metrics", headers=admin_headers(admin_key))
        return parse_metrics(response.text) if response.status_code == 200 else {}
    except httpx.HTTPError:
        return {}
