"""A server reports its own cold start on /metrics, layer by layer (issue 19): runtime,
weights and warm-up (``kvserve_cold_start_seconds{layer}``) and the engine's phases. With the
host-memory weight cache a second start's weights layer is shorter: a warm model reads its
packed weights from host memory instead of unpacking the GGUF (layer 2 skipped)."""
from __future__ import annotations

import httpx
import pytest

from benchmarks.server_process import ServerProcess
from kvserve.server.metrics import parse_metrics

pytestmark = [pytest.mark.model, pytest.mark.server]


def start_layers(*args: str) -> dict[str, float]:
    with ServerProcess("--threads", "1", "--kv-cache-gib", "0.05", *args) as server:
        samples = parse_metrics(httpx.get(server.url + "/metrics", timeout=30).text)
    layers = {k.split('"')[1]: v for k, v in samples.items() if k.startswith("kvserve_cold_start_seconds{")}
    phases = {k.split('"')[1]: v for k, v in samples.items() if k.startswith("kvserve_start_phase_seconds{")}
    assert set(layers) == {"runtime", "weights", "warmup"} and all(v >= 0 for v in layers.values())
    assert layers["weights"] == pytest.approx(phases["checkpoint"] + phases["weights"], abs=2e-3)
    return layers


def test_the_weights_layer_is_shorter_from_the_host_cache(tmp_path):
    cache = str(tmp_path / "weights")
    filled = start_layers("--weight-cache", cache)            # a miss: reads the GGUF, stores the packed weights
    hit = start_layers("--weight-cache", cache)               # a hit: maps them from host memory
    assert hit["weights"] < filled["weights"], (hit, filled)
    assert hit["runtime"] > 0 and hit["warmup"] > 0
