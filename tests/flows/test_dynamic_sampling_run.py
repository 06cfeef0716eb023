"""rollout.dynamic_sampling in a run: the steps train groups with a spread where the extra rounds
found them, the step metrics count what was generated and dropped, and the rows are
deterministic: a rerun of the run and a run resumed by a new driver give the same Zarr arrays
and weights bit for bit."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from conftest import assert_same_runs
from flows.cluster import start_cluster
from flows.config import load_config
from flows.loop import run, run_folder
from stages.advantage import informative_groups
from storage.rollouts import RolloutStore

pytestmark = pytest.mark.slow

ITERATIONS = 3


def _config(runs_dir: Path, name: str, *extra: str):
    # digit_match gives partial credit, so after the short warm-up some groups have a spread and
    # some do not: both kinds of slot occur.
    return load_config("configs/tiny.yaml", [
        f"iterations={ITERATIONS}", f"run_name={name}", f"runs_dir={runs_dir}", "warmup.steps=30",
        "task.prompts_per_step=8", "train.micro_batch_size=16", "rollout.num_engines=2",
        "reward.functions=[digit_match]", "rollout.dynamic_sampling=true", *extra])


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    runs_dir = tmp_path_factory.mktemp("dynamic")
    first = _config(runs_dir, "first")
    client, cluster = start_cluster(first)
    try:
        shared = replace(first.cluster, scheduler_address=cluster.scheduler_address)
        out = {}
        for name, extra in (("first", ()), ("rerun", ()), ("resumed", ("iterations=2",)), ("resumed", ())):
            cfg = replace(_config(runs_dir, name, *extra), cluster=shared)
            out[name] = (Path(run_folder(cfg).root), run(cfg, progress=False).metrics)
        yield out
    finally:
        client.close()
        cluster.close()


def test_rerun_and_resume_regenerate_the_same_rows(runs):
    first, _ = runs["first"]
    assert_same_runs(first, runs["rerun"][0], ITERATIONS, ITERATIONS + 1)
    assert_same_runs(first, runs["resumed"][0], ITERATIONS, ITERATIONS + 1)


def test_steps_count_what_they_generated_and_train_informative_groups(runs):
    run_dir, metrics = runs["first"]
    store = RolloutStore(run_dir / "rollouts.zarr")
    G, slots = 8, 8
    refilled = 0
    for step, m in enumerate(metrics):
        a = store.read(step, "reward", "reward_failed", "group_id")
        informative = informative_groups(a["reward"], a["reward_failed"], G)
        assert m["groups_unfilled"] == (~informative).sum() == m["zero_variance_groups"] + m["untrained_groups"]
        assert m["groups_generated"] == slots + m["groups_dropped"] >= slots
        assert 1 <= m["sampling_rounds"] <= 4 and m["generated_length_mean"] > 0
        extra = a["group_id"][::G] >= 1 << 40  # groups from the extra rounds
        refilled += extra.sum()
        assert informative[extra].all()  # only groups with a spread are taken from a round
    assert refilled > 0  # the case was exercised
