"""A 4-iteration run whose driver is SIGKILLed again and again (right after a stage of a step is
marked complete, and once at a random point inside the train stage) and rerun each time ends
bit for bit where an uninterrupted run does: final weights and optimiser state (sha256), every
array of every Zarr step, and the training metrics in summary.json. Each kill's Dask workers
must exit with the driver, so none writes into the rerun."""

from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from storage.policies import PolicyStore
from storage.rollouts import ARRAYS, RolloutStore

pytestmark = pytest.mark.slow

ITERATIONS = 4
OVERRIDES = [f"iterations={ITERATIONS}", "warmup.steps=5", "task.prompts_per_step=8", "train.micro_batch_size=16",
             "reward.functions=[digit_match]", "cluster.num_plain_workers=1"]
# (step, stage whose completion mark triggers the kill); the last one kills inside the train stage.
KILLS = [(0, "rollout"), (0, "reference"), (1, "advantage"), (1, "train"), (2, "publish"), (2, "lineage"),
         (3, "advantage+random")]
DRIVER = ("import sys\nfrom flows.config import load_config\nfrom flows.loop import run\n"
          "run(load_config('configs/tiny.yaml', sys.argv[1:]), progress=False)\n")
METRICS = ("reward_mean", "reward_std", "loss", "kl", "clip_fraction", "grad_norm", "completion_length_mean")


def _driver(runs: Path, name: str, env: dict) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", DRIVER, *OVERRIDES, f"runs_dir={runs}", f"run_name={name}"],
                            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True)


def _marks(run: Path, step: int) -> list[str]:
    try:
        return json.loads((run / "rollouts.zarr" / f"step_{step}" / "zarr.json").read_text())["attributes"]["complete"]
    except (OSError, ValueError, KeyError):
        return []


def _children(pid: int) -> list[int]:
    out = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            out.append(int(stat.parent.name))
    return out


def _cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def _kill_when(proc: subprocess.Popen, run: Path, step: int, stage: str, rng: random.Random) -> list[int]:
    """SIGKILL the driver once ``stage`` of ``step`` is marked (plus a random delay for
    "<stage>+random"); returns the worker processes it had then."""
    stage, _, jitter = stage.partition("+")
    deadline = time.time() + 900
    while stage not in _marks(run, step):
        assert proc.poll() is None, f"the driver ended before step {step} {stage}: {proc.stderr.read().decode()[-2000:]}"
        assert time.time() < deadline, f"step {step} {stage} never marked"
        time.sleep(0.02)
    if jitter:  # a random point inside the stages after it, no later than publish (which marks train)
        until = time.time() + rng.uniform(0.0, 1.5)
        while time.time() < until and "train" not in _marks(run, step) and proc.poll() is None:
            time.sleep(0.02)
    # A mark written before this driver started (an earlier driver's last tasks, or a step that ran
    # while the previous step's lineage was still being written) must not kill it before it has
    # workers: their exit is what the orphan check is about.
    while not any(b"resource_tracker" not in _cmdline(p) for p in _children(proc.pid)):
        assert proc.poll() is None, f"the driver ended before starting workers: {proc.stderr.read().decode()[-2000:]}"
        assert time.time() < deadline, "the driver never started its workers"
        time.sleep(0.02)
    workers = _children(proc.pid)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    return workers


def _finish(proc: subprocess.Popen) -> None:
    _, err = proc.communicate(timeout=900)
    assert proc.returncode == 0, err.decode()[-3000:]


@pytest.fixture(scope="module")
def two_runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("kill")
    env = {**os.environ, "GRPOFLOW_CACHE": str(root / "cache"), "PYTHONPATH": os.getcwd()}
    _finish(_driver(root / "a", "r", env))  # uninterrupted (also fills the base-policy cache)
    rng = random.Random(0)
    orphans = []
    for step, stage in KILLS:
        workers = _kill_when(_driver(root / "b", "r", env), root / "b" / "r", step, stage, rng)
        orphans.append((step, stage, workers))
        deadline = time.time() + 10
        while any(_alive(p) for p in workers) and time.time() < deadline:
            time.sleep(0.1)
        orphans[-1] += ([p for p in workers if _alive(p)],)
    # A copy of the killed run under another runs_dir and run_name resumes too, and leaves the original alone.
    shutil.copytree(root / "b" / "r", root / "c" / "copy", symlinks=True)
    before = _tree_digest(root / "b" / "r")
    _finish(_driver(root / "c", "copy", env))
    original_untouched = _tree_digest(root / "b" / "r") == before
    _finish(_driver(root / "b", "r", env))
    return root / "a" / "r", root / "b" / "r", orphans, (root / "c" / "copy", original_untouched)


def _tree_digest(root: Path) -> str:
    digest = hashlib.sha256()
    for path in sorted(p for p in root.rglob("*") if p.is_file()):
        digest.update(str(path.relative_to(root)).encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()


def test_killed_workers_exit_with_the_driver(two_runs):
    _, _, orphans, _ = two_runs
    assert all(workers for _, _, workers, _ in orphans)
    assert [(s, st, alive) for s, st, _, alive in orphans if alive] == []


def test_final_policy_and_optimizer_state_equal(two_runs):
    a, b, *_ = two_runs
    pa, pb = PolicyStore(a / "policy"), PolicyStore(b / "policy")
    for v in range(ITERATIONS + 1):
        assert pa.verify(v).sha256 == pb.verify(v).sha256, f"v{v}"
    ma = json.loads((a / "policy" / f"v{ITERATIONS}" / "grpoflow.json").read_text())
    mb = json.loads((b / "policy" / f"v{ITERATIONS}" / "grpoflow.json").read_text())
    assert ma["optimizer_sha256"] == mb["optimizer_sha256"] and ma["optimizer_ranks"] == 2
    # train.keep_optimizer_state=latest: the state of every version but the last two is deleted once
    # the steps after it are logged, in the killed-and-resumed run as in the other.
    for run, store in ((a, pa), (b, pb)):
        kept = [v for v in range(1, ITERATIONS + 1) if (run / "policy" / f"v{v}" / "optim").exists()]
        assert kept == [ITERATIONS - 1, ITERATIONS], run.name
        assert [store.optimizer_ranks(v) for v in range(1, ITERATIONS + 1)] == [0] * (ITERATIONS - 2) + [2, 2]


def test_every_zarr_array_equal(two_runs):
    a, b, *_ = two_runs
    sa, sb = RolloutStore(a / "rollouts.zarr"), RolloutStore(b / "rollouts.zarr")
    assert sa.steps() == sb.steps() == list(range(ITERATIONS))
    for step in range(ITERATIONS):
        ra, rb = sa.read(step, *ARRAYS), sb.read(step, *ARRAYS)
        for name in ARRAYS:
            np.testing.assert_array_equal(ra[name], rb[name], err_msg=f"step {step} {name}")


def test_training_metrics_equal_and_summary_covers_every_step(two_runs):
    a, b, *_ = two_runs
    ja, jb = (json.loads((r / "summary.json").read_text()) for r in (a, b))
    assert [m["step"] for m in jb["metrics"]] == list(range(ITERATIONS))
    for ma, mb in zip(ja["metrics"], jb["metrics"]):
        assert {k: ma[k] for k in METRICS} == {k: mb[k] for k in METRICS}, ma["step"]
    assert any(m["loss"] != 0.0 for m in ja["metrics"])  # a step that trained on something
    # one MLflow parent run across every restart, with one child run per step
    assert jb["mlflow_run_id"] == json.loads((b / "run.json").read_text())["mlflow_run_id"]
    from storage.lineage import iteration_runs

    children = iteration_runs(jb["tracking_uri"], jb["mlflow_run_id"])
    assert list(children["tags.grpoflow.step"]) == [str(s) for s in range(ITERATIONS)]


def test_a_copied_run_folder_resumes_under_its_new_name(two_runs):
    a, _, _, (copy, original_untouched) = two_runs
    assert original_untouched  # the copy's resume wrote nothing into the folder it was copied from
    pa, pc = PolicyStore(a / "policy"), PolicyStore(copy / "policy")
    assert pc.verify(ITERATIONS).sha256 == pa.verify(ITERATIONS).sha256
    summary = json.loads((copy / "summary.json").read_text())
    assert [m["step"] for m in summary["metrics"]] == list(range(ITERATIONS))
    import mlflow

    client = mlflow.tracking.MlflowClient(summary["tracking_uri"])
    parent = client.get_run(summary["mlflow_run_id"])
    assert parent.info.run_name == "copy"
    assert parent.info.artifact_uri.startswith(f"{copy}/mlartifacts/")
