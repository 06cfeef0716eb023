"""The grpoflow command line: errors, the UI and the planner entry."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from stages.train.rendezvous import free_port

GRPOFLOW = [sys.executable, "-m", "flows.cli"]


def test_bad_override_is_one_line_and_exit_2():
    proc = subprocess.run(GRPOFLOW + ["run", "configs/tiny.yaml", "train.schedule=zigzag"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "train.schedule" in lines[0]


def test_ui_serves_the_run_store_on_loopback(tmp_path):
    port = free_port()
    proc = subprocess.Popen(GRPOFLOW + ["ui", "configs/tiny.yaml", f"runs_dir={tmp_path}", "--port", str(port)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        first = proc.stdout.readline()
        assert f"http://127.0.0.1:{port}" in first and "sqlite:///" in first
        deadline, status = time.monotonic() + 90, None
        while time.monotonic() < deadline and status is None:
            try:
                status = urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2).status
            except OSError:
                time.sleep(1.0)
        assert status == 200
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=30)


def test_plan_writes_the_report(tmp_path):
    proc = subprocess.run(GRPOFLOW + ["plan", "configs/seed-70b.yaml", "--out", str(tmp_path)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert (tmp_path / "plan.json").exists() and (tmp_path / "report.md").exists()
    assert list(tmp_path.glob("*.png"))
