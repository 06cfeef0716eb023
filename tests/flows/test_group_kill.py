"""A run whose whole process group is SIGKILLed (``kill -9 -- -PGID``) leaves no POSIX semaphore
behind: multiprocessing's resource tracker runs in a session of its own (flows/cluster.py) and
unlinks the killed processes' semaphores once they are gone."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import pids_where

pytestmark = pytest.mark.slow

DRIVER = ("import sys\nfrom flows.config import load_config\nfrom flows.loop import run\n"
          "run(load_config('configs/tiny.yaml', sys.argv[1:]), progress=False)\n")


def _semaphores_of(pids: set[int]) -> set[str]:
    """The /dev/shm semaphores mapped by any of ``pids``."""
    found = set()
    for pid in pids:
        try:
            maps = Path(f"/proc/{pid}/maps").read_text()
        except OSError:
            continue
        found.update(line.split()[-1] for line in maps.splitlines() if "/dev/shm/sem." in line)
    return found


@pytest.mark.skipif(sys.platform != "linux" or not Path("/dev/shm").is_dir(), reason="Linux /dev/shm semaphores")
def test_a_group_kill_leaves_no_semaphore(tmp_path):
    env = {**os.environ, "GRPOFLOW_CACHE": str(tmp_path / "cache"), "PYTHONPATH": os.getcwd()}
    proc = subprocess.Popen([sys.executable, "-c", DRIVER, "iterations=200", f"runs_dir={tmp_path}", "run_name=r",
                             "cluster.num_plain_workers=1"], env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, start_new_session=True)
    deadline = time.time() + 300
    while not (tmp_path / "r" / "rollouts.zarr" / "step_1").exists():  # workers up, a step run
        assert proc.poll() is None, proc.stderr.read().decode()[-2000:]
        assert time.time() < deadline, "no step ran"
        time.sleep(0.1)
    sems = _semaphores_of(pids_where("pgrp", proc.pid))
    assert sems, "the run's processes map no semaphore: nothing to check"
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    deadline = time.time() + 20
    while any(Path(s).exists() for s in sems) and time.time() < deadline:
        time.sleep(0.2)
    assert not [s for s in sems if Path(s).exists()], "semaphores left in /dev/shm after the group kill"
