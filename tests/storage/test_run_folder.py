"""The run folder owns every path of a run and writes the run-level files."""

from __future__ import annotations

import json
import pickle
from pathlib import Path

import pytest

from storage.run_folder import CACHE_ENV, RunFolder, RunFolderError


def test_layout_of_a_run_folder(tmp_path, monkeypatch):
    monkeypatch.delenv(CACHE_ENV, raising=False)
    folder = RunFolder.at(tmp_path / "runs", "demo")
    root = tmp_path.resolve() / "runs" / "demo"
    assert folder.root == str(root)
    assert folder.rollouts == str(root / "rollouts.zarr")
    assert folder.policies == str(root / "policy")
    assert folder.timelines == str(root / "timelines")
    assert folder.trace(3) == str(root / "timelines" / "step_3.json")
    assert folder.artifacts == str(root / "mlartifacts")
    assert folder.summary == str(root / "summary.json")
    assert folder.tracking_uri == f"sqlite:///{root / 'mlflow.db'}"
    assert folder.base_policy_cache("k") == str(tmp_path.resolve() / "runs" / "_cache" / "base-k")
    assert folder.rollout_store().root == folder.rollouts and folder.policy_store().root == Path(folder.policies)
    assert pickle.loads(pickle.dumps(folder)) == folder  # Dask tasks carry it


def test_cache_comes_from_the_argument_then_the_environment(tmp_path, monkeypatch):
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "shared"))
    assert RunFolder.at(tmp_path, "r").cache_root == str((tmp_path / "shared").resolve())
    assert RunFolder.at(tmp_path, "r", cache_dir=str(tmp_path / "mine")).cache_root == str((tmp_path / "mine").resolve())


def test_summary_and_trace_round_trip_as_json(tmp_path):
    folder = RunFolder.at(tmp_path, "r").create()
    assert Path(folder.timelines).is_dir()
    path = folder.save_summary({"iterations": 2, "reward_mean": [0.25, 0.5]})
    assert path == folder.summary and folder.load_summary() == {"iterations": 2, "reward_mean": [0.25, 0.5]}
    events = [{"name": "F0", "ph": "X", "ts": 0, "dur": 5, "pid": 1}]
    trace = json.loads(Path(folder.save_trace(4, events)).read_text())
    assert trace == {"traceEvents": events, "displayTimeUnit": "ms"}
    assert not list(Path(folder.root).rglob("*.tmp"))  # written through a temporary, then renamed


def test_errors_name_the_file(tmp_path):
    folder = RunFolder.at(tmp_path, "r")
    with pytest.raises(RunFolderError, match="summary.json"):
        folder.load_summary()
    Path(folder.root).parent.mkdir(parents=True, exist_ok=True)
    Path(folder.root).write_text("a file where the folder should be")
    with pytest.raises(RunFolderError, match="step_0.json"):
        folder.save_trace(0, [])
