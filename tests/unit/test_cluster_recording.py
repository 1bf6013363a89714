"""The fleet simulator check's recordings (``benchmarks/cluster_recording.py``): a saved run reads
back whole, its hardware entry is handed to the simulator as a file and removed after, and a
file of another format is refused by name. Test 4 (tests/cluster) replays a real run's."""
from __future__ import annotations

import gzip
import json
import os
import pickle

import pytest

from benchmarks.cluster_recording import FORMAT, Recording, RecordingFormatError
from kvserve.fleetsim.trace_shape import TraceShape


def _recording(tmp_path) -> Recording:
    hardware = tmp_path / "local.json"
    hardware.write_text(json.dumps({"name": "local", "calibration": {"rms_relative_error": 0.03}}))
    run = {"changes": [[0.0, {"RUNNING": 1}], [41.5, {"RUNNING": 1, "STARTING": 1}]], "probe_lead_s": 2.5}
    shape = TraceShape(128, 24, 0.3, 1.0)
    return Recording.of(str(hardware), [[35.0, 0.25], [40.0, 0.8]], shape, 5.0, 20.0, 7, "auto", 2, run)


def test_a_saved_recording_reads_back_whole(tmp_path):
    recording = _recording(tmp_path)
    path = str(tmp_path / "run7.pkl.gz")
    recording.save(path)
    loaded = Recording.load(path)
    assert loaded == recording
    assert loaded.phases == [(35.0, 0.25), (40.0, 0.8)] and loaded.host_cores == 2 and loaded.seed == 7
    assert json.loads(loaded.hardware)["calibration"]["rms_relative_error"] == 0.03


def test_the_hardware_entry_is_a_file_while_it_is_used(tmp_path):
    recording = _recording(tmp_path)
    with recording.hardware_file() as path:
        with open(path) as f:
            assert f.read() == recording.hardware
    assert not os.path.exists(path) and not os.path.exists(os.path.dirname(path))


@pytest.mark.parametrize("saved", [{"format": FORMAT + 1, "recording": None}, ["not", "a", "recording"]])
def test_another_format_is_refused_by_name(tmp_path, saved):
    path = str(tmp_path / "old.pkl.gz")
    with gzip.open(path, "wb") as f:
        pickle.dump(saved, f)
    with pytest.raises(RecordingFormatError, match=f"this code reads {FORMAT}"):
        Recording.load(path)
