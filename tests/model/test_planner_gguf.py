"""Tier 2: the planner reads the default model's GGUF (its parameter count is the file's
tensors). The rest of the planner CLI: tests/unit/test_planner_cli.py."""
from __future__ import annotations

import json
import os

import pytest

from kvserve.planner.cli import main
from kvserve.planner.model_io import default_gguf_path, resolve_model
from kvserve.planner.models import param_counts


def run_json(capsys, *argv) -> tuple[int, dict]:
    code = main(["plan", *argv, "--json"])
    return code, json.loads(capsys.readouterr().out)


@pytest.mark.skipif(default_gguf_path() is None or not os.path.exists(default_gguf_path() or ""),
                    reason="default GGUF not installed")
def test_gguf_input_matches_its_tensors(capsys):
    import gguf

    path = default_gguf_path()
    m = resolve_model(path)
    reader = gguf.GGUFReader(path)
    assert param_counts(m).total == sum(int(t.n_elements) for t in reader.tensors)
    assert (m.num_layers, m.num_heads, m.num_kv_heads, m.head_dim) == (30, 9, 3, 64)
    code, out = run_json(capsys, "--model", path, "--gpu", "l4", "--context", "2048", "--concurrency", "8")
    assert code == 0 and out["weight_bytes"] == m.native_weight_bytes and out["tp"] == 1
