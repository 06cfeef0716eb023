"""Asynchronous runs through a real embedded Dask cluster: deterministic, and within the bound. The
second run sends each version to the engine in memory (cluster.weight_sync=memory), the first only
through disk: the same rows and weights either way."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from conftest import assert_loaded_from, assert_same_runs
from flows.config import load_config
from flows.loop import run
from storage.rollouts import RolloutStore

pytestmark = pytest.mark.slow


def _run(runs_dir: Path, name: str, *overrides: str):
    cfg = load_config("configs/tiny.yaml", [
        "iterations=3", f"run_name={name}", f"runs_dir={runs_dir}", "warmup.steps=100",
        "task.prompts_per_step=8", "train.micro_batch_size=16", "rollout.max_staleness=1", *overrides])
    return cfg, run(cfg, progress=False)


@pytest.fixture(scope="module")
def two_runs(tmp_path_factory):
    runs_dir = tmp_path_factory.mktemp("runs")
    a = _run(runs_dir, "async-a")
    b = _run(runs_dir, "async-b", "cluster.weight_sync=memory")
    return runs_dir, a, b


def test_two_async_runs_are_identical(two_runs):
    runs_dir, _, _ = two_runs
    assert_same_runs(runs_dir / "async-a", runs_dir / "async-b", 3, 4)  # policy v0 .. v3


def test_versions_and_staleness_follow_the_rule(two_runs):
    runs_dir, (cfg, summary), _ = two_runs
    store = RolloutStore(runs_dir / "async-a" / "rollouts.zarr")
    for step, behaviour in zip(range(3), (0, 0, 1)):  # max(0, k - 1)
        attrs = store.attrs(step)
        assert attrs["policy_version"] == behaviour and attrs["trainer_version"] == step
        rows = store.read(step, "policy_version")
        assert np.all(rows["policy_version"] == behaviour)
    # pi_prox is the trainer's current weights (train.off_policy.proximal = current): at step 0 the
    # trainer and the sampler are both v0, so every importance weight is 1 up to float rounding; later
    # steps train on rows of the previous version.
    first = summary.metrics[0]
    assert abs(first["is_weight_max"] - 1.0) < 1e-3 and first["is_truncated_fraction"] == 0.0
    assert summary.metrics[1]["is_weight_max"] > first["is_weight_max"]
    stale = [m["staleness_max"] for m in summary.metrics]
    assert stale == [0.0, 1.0, 1.0]
    for m in summary.metrics:
        for key in ("is_weight_mean", "is_truncated_fraction", "clip_fraction_low", "kl_behav",
                    "rollout_idle_seconds", "train_idle_seconds"):
            assert key in m, key


def test_the_memory_run_generated_from_the_weights_it_received(two_runs):
    runs_dir, (_, disk), (cfg, memory) = two_runs
    # s = 1: steps 0 and 1 generate from v0 (the version the ranks were built from, on disk; step 1
    # finds it held), step 2 from v1, which step 0 sent while step 1's rollout ran. Any engine may
    # take any of a step's prompt ranges, so an engine that ran two finds the version held at its
    # second: per step, each engine used loads once and the step's other tasks find it held.
    folder, n = runs_dir / "async-b", cfg.rollout.num_engines
    from_disk, from_memory = assert_loaded_from(folder, 0, "disk", n), assert_loaded_from(folder, 2, "memory", n)
    assert [r["weights_from"] for r in RolloutStore(folder / "rollouts.zarr").attrs(1)["results_rollout"]] == ["held"] * n
    loads = [(m["weight_loads_from_memory"], m["weight_loads_from_disk"]) for m in memory.metrics]
    assert loads == [(0, len(from_disk)), (0, 0), (len(from_memory), 0)]
    assert all(m["weight_sync_memory_send_failures"] == 0 for m in memory.metrics)
    assert memory.metrics[2]["weight_sync_memory_receive_bytes"] == memory.metrics[0]["weight_sync_memory_send_bytes"]
    assert all("weight_sync_memory_send_seconds" not in m and m["weight_loads_from_memory"] == 0
               for m in disk.metrics)
