"""``kvserve profile --dtype``: the profile times the engine in the weights the server will run,
and the entry plans in them (its ``calibration``'s ``dtype`` / ``weight_dtype``)."""
from __future__ import annotations

import pytest

from kvserve.cli import build_parser
from kvserve.fleetsim.host_contention import MODULE, probe_command
from kvserve.planner.profile import open_engine, runs_kv_bytes

pytestmark = pytest.mark.model


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_profiled_engine_runs_in_the_dtype_asked_for(dtype):
    generate, facts = open_engine(None, 1, runs_kv_bytes(None, [((16,), 2)]), dtype)
    generate([[101] * 16], 2)
    assert facts["dtype"] == dtype


def test_the_flag_defaults_to_the_engines_choice_and_reaches_the_contention_probe():
    args = build_parser().parse_args(["profile", "--quick"])
    assert args.dtype == "auto"
    assert build_parser().parse_args(["profile", "--dtype", "float32"]).dtype == "float32"
    command = probe_command(MODULE, 1, (4, 128, 24), "float32", "--runs", "2")
    assert command[command.index("--dtype") + 1] == "float32" and command[-2:] == ["--runs", "2"]
