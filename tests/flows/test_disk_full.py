"""A run whose disk fills up stops with one line that names the full disk and the way on (not a
traceback, not a later bookkeeping error in place of the first), and once space is freed the same
command finishes it bit for bit as an uninterrupted run, every MLflow child run FINISHED.

The full disk is a small tmpfs mounted for the test (root only; skipped where mounting fails)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import TINY_CLI_ITERATIONS, TINY_CLI_OVERRIDES, assert_same_runs

pytestmark = [pytest.mark.slow, pytest.mark.system]

ITERATIONS = TINY_CLI_ITERATIONS  # the uninterrupted run is the session's tiny_cli_run
GRPOFLOW = [sys.executable, "-m", "flows.cli", "run", "configs/tiny.yaml"]


@pytest.fixture
def small_disk(tmp_path):
    disk = tmp_path / "disk"
    disk.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=7M", "tmpfs", str(disk)], capture_output=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.decode().strip()}")
    try:
        yield disk
    finally:
        subprocess.run(["umount", "-l", str(disk)], check=False)


def _run(runs_dir: Path, env: dict) -> subprocess.CompletedProcess:
    return subprocess.run([*GRPOFLOW, f"runs_dir={runs_dir}", *TINY_CLI_OVERRIDES], env=env, capture_output=True,
                          text=True, timeout=600)


def test_a_full_disk_stops_in_one_line_and_resumes_exactly(tmp_path, small_disk, tiny_cli_run):
    env = {**os.environ, "GRPOFLOW_CACHE": str(tmp_path / "cache"), "PYTHONPATH": os.getcwd()}
    full = _run(small_disk, env)
    assert full.returncode == 1, full.stderr[-3000:]
    last = full.stderr.strip().splitlines()[-1]
    # The first write to fail (a policy shard, a Zarr chunk, MLflow's SQLite store: which one fills
    # the disk depends on timing) is the one named.
    assert last.startswith("grpoflow: the disk is full: "), full.stderr[-3000:]
    assert "No space left on device" in last or "database or disk is full" in last, last
    assert last.endswith("free space and run the same command to resume")
    assert "Traceback (most recent call last)" not in full.stderr, full.stderr[-3000:]
    assert not (small_disk / "r" / "summary.json").exists()  # it stopped before the end

    subprocess.run(["mount", "-o", "remount,size=1G", str(small_disk)], check=True)
    resumed = _run(small_disk, env)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert_same_runs(tiny_cli_run, small_disk / "r", ITERATIONS, min_weight_files=2 * ITERATIONS)

    from storage.lineage import iteration_runs

    summary = json.loads((small_disk / "r" / "summary.json").read_text())
    runs = iteration_runs(summary["tracking_uri"], summary["mlflow_run_id"])
    assert sorted(runs["tags.grpoflow.step"]) == [str(s) for s in range(ITERATIONS)]
    assert set(runs["status"]) == {"FINISHED"}, list(runs["status"])
