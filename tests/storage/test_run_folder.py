"""The run folder owns every path of a run and writes the run-level files."""

from __future__ import annotations

import json
import os
import pickle
import signal
import subprocess
import sys
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


def test_a_run_folder_has_one_driver_at_a_time(tmp_path):
    folder = RunFolder.at(tmp_path, "r")
    with folder.lock():
        with pytest.raises(RunFolderError, match=rf"in use by another grpoflow process \(pid {os.getpid()}\)") as info:
            with folder.lock():
                pass
        assert "\n" not in str(info.value)
    with folder.lock():  # released with the block
        pass
    assert not Path(folder.root).exists()  # the lock lives beside the folder, which it does not create


def test_the_lock_of_a_killed_driver_is_taken_over(tmp_path):
    folder = RunFolder.at(tmp_path, "r")
    holder = subprocess.Popen([sys.executable, "-c", (
        "import sys, time\nfrom storage.run_folder import RunFolder\n"
        f"with RunFolder.at({str(tmp_path)!r}, 'r').lock():\n    print('held', flush=True)\n    time.sleep(60)")],
        stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(RunFolderError, match=f"pid {holder.pid}"):
            with folder.lock():
                pass
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait(timeout=30)
    with folder.lock():  # the kernel dropped the dead process's lock
        assert Path(folder.lock_file).read_text().strip() == str(os.getpid())
