"""GRPO runs whose rollouts vLLM generates (rollout.engine=vllm), through a real embedded cluster:
synchronous with in-memory weight sync, again with the vLLM server killed in the middle (the run
must equal the first bit for bit: nothing lost, and vLLM reproducible run to run on this host),
and asynchronous (rollout.max_staleness=1). Needs .venv-vllm (`make vllm`; `make test` builds it)."""

from __future__ import annotations

import json
import os
import signal
import threading
import time

import psutil
import pytest

from conftest import assert_same_runs
from flows.config import load_config
from flows.loop import run
from storage.rollouts import RolloutStore

pytestmark = pytest.mark.slow

# The tiny config's model with vLLM's smallest CPU attention head (32), one engine, a short warm-up.
_VLLM = ["rollout.engine=vllm", "model.num_attention_heads=2", "model.num_key_value_heads=1", "warmup.steps=40",
         "rollout.num_engines=1", "task.prompts_per_step=16", "train.micro_batch_size=32", "iterations=3"]


@pytest.fixture(scope="module")
def runs_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("vllm-runs")  # one base-policy cache for the module's runs


def _run(runs_dir, name: str, *overrides: str):
    cfg = load_config("configs/tiny.yaml", [*_VLLM, f"runs_dir={runs_dir}", f"run_name={name}", *overrides])
    return cfg, run(cfg, progress=False)


def _metrics(runs_dir, name: str) -> list[dict]:
    return json.loads((runs_dir / name / "summary.json").read_text())["metrics"]


def _servers() -> list[psutil.Process]:
    return [p for p in psutil.Process().children(recursive=True)
            if any(part.endswith("vllm_server.py") for part in p.cmdline())]


@pytest.fixture(scope="module")
def synchronous(runs_dir):
    _run(runs_dir, "sync", "cluster.weight_sync=memory")
    return runs_dir / "sync"


def test_a_synchronous_run_generates_with_vllm_and_takes_versions_from_memory(synchronous):
    metrics = _metrics(synchronous.parent, "sync")
    assert [m["step"] for m in metrics] == [0, 1, 2]
    assert [m["engine_starts"] for m in metrics] == [1, 0, 0]  # started once, kept across steps
    assert [m["weight_loads_from_memory"] for m in metrics] == [0, 1, 1]  # v0 from its folder, then memory
    for m in metrics:
        assert abs(m["kl_behav"]) < 1e-6, m["kl_behav"]  # engine/trainer mismatch: rounding only
        assert m["is_weight_max"] < 1.01  # TIS weights of that mismatch (on by default with vLLM)
    store = RolloutStore(synchronous / "rollouts.zarr")
    rows = store.read(2, "policy_version", "length")
    assert (rows["policy_version"] == 2).all() and rows["length"].min() >= 1
    assert not _servers()  # the run's end closed the server


def test_a_killed_server_is_survived_and_the_run_equals_the_uninterrupted_one(runs_dir, synchronous):
    """The server is SIGKILLed once step 0's rollout is stored; the next rollout starts it again on
    the version it asks for. vLLM's samples on this host depend only on the seeds and the batch, so
    the run equals the one above bit for bit: arrays and weights."""
    killed, stop = [], threading.Event()

    def kill_after_step_0() -> None:
        store = RolloutStore(runs_dir / "killed" / "rollouts.zarr")
        while not stop.is_set() and not killed:
            try:
                done = 0 in store.steps() and "rollout" in store.completed(0)
            except Exception:  # the store is not made yet
                done = False
            servers = _servers() if done else []
            for p in servers:
                os.kill(p.pid, signal.SIGKILL)
                killed.append(p.pid)
            time.sleep(0.05)

    watcher = threading.Thread(target=kill_after_step_0, daemon=True)
    watcher.start()
    try:
        _run(runs_dir, "killed", "cluster.weight_sync=memory")
    finally:
        stop.set()
        watcher.join(5)
    assert len(killed) == 1
    starts = [m["engine_starts"] for m in _metrics(runs_dir, "killed")]
    assert starts[0] == 1 and sum(starts[1:]) == 1, starts  # started again once, at step 1 or 2
    assert_same_runs(synchronous, runs_dir / "killed", steps=3, min_weight_files=4)


def test_an_asynchronous_run_generates_from_stale_versions_with_vllm(runs_dir):
    _run(runs_dir, "async", "rollout.max_staleness=1")
    metrics = _metrics(runs_dir, "async")
    assert [m["step"] for m in metrics] == [0, 1, 2] and metrics[0]["engine_starts"] == 1
    store = RolloutStore(runs_dir / "async" / "rollouts.zarr")
    # Step k generates from version max(0, k - 1): the version tag each row records.
    assert [int(store.read(k, "policy_version")["policy_version"].max()) for k in range(3)] == [0, 0, 1]
    assert metrics[2]["staleness_max"] == 1 and metrics[2]["is_weight_mean"] > 0
