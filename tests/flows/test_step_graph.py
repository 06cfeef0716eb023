"""Where a step's reference pass and reward scoring run is a choice of graph, not of result: the
reference inside the train tasks (train.reference_pass=fused) and the scoring inside the rollout
tasks (reward.in_rollout) give the run of separate stages bit for bit (every Zarr array, every
policy file), here on two engines colocated with the training ranks. The marks and the
measurements of the stages run inside others are where the separate stages put theirs."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from benchmarks.critical_path import TILES, run_parts
from conftest import assert_same_runs
from flows.cluster import start_cluster
from flows.config import load_config
from flows.loop import run, run_folder
from storage.rollouts import RolloutStore

pytestmark = pytest.mark.slow

ITERATIONS = 3
SEPARATE = ["train.reference_pass=separate", "reward.in_rollout=false"]
INSIDE = ["train.reference_pass=fused", "reward.in_rollout=true"]
SCORED = ["train.reference_pass=separate", "reward.in_rollout=true"]  # the reference task after the scoring gate
# kl_beta 0: a reference pass only for the kl metric, or none (train.reference=auto).
# Partial credit per digit: after the 30-step warm-up groups have a spread, so these steps train.
KL0_PASS = ["train.kl_beta=0", "train.reference=always", "reward.functions=[digit_match]", *INSIDE]
KL0 = ["train.kl_beta=0", "reward.functions=[digit_match]", *INSIDE]


def _config(runs_dir: Path, name: str, graph: list[str]):
    return load_config("configs/tiny.yaml", [
        f"iterations={ITERATIONS}", f"run_name={name}", f"runs_dir={runs_dir}", "warmup.steps=30",
        "task.prompts_per_step=8", "train.micro_batch_size=16", "cluster.placement=colocated",
        "rollout.num_engines=2", *graph])


@pytest.fixture(scope="module")
def graphs(tmp_path_factory):
    """(run folder, metrics) of the separate stages, of both stages inside others, and of the
    scoring alone inside the rollout, on one cluster of the tiny config's layout: two engines
    colocated with the two training ranks."""
    runs_dir = tmp_path_factory.mktemp("graphs")
    separate = _config(runs_dir, "separate", SEPARATE)
    client, cluster = start_cluster(separate)
    try:
        shared = replace(separate.cluster, scheduler_address=cluster.scheduler_address)
        out = []
        for name, graph in (("separate", SEPARATE), ("inside", INSIDE), ("scored", SCORED), ("kl0-pass", KL0_PASS),
                            ("kl0", KL0)):
            cfg = replace(_config(runs_dir, name, graph), cluster=shared)
            out.append((Path(run_folder(cfg).root), run(cfg, progress=False).metrics))
        yield out
    finally:
        client.close()
        cluster.close()


def test_stages_inside_others_give_the_separate_stages_run(graphs):
    (separate, _), (inside, _), (scored, _) = graphs[:3]
    assert_same_runs(separate, inside, ITERATIONS, ITERATIONS + 1)
    assert_same_runs(separate, scored, ITERATIONS, ITERATIONS + 1)


def test_kl_beta_0_skips_the_reference_and_trains_the_same_weights(graphs):
    """At kl_beta 0 the reference's log-probs add 0 x KL to the loss: the step without the pass
    (no reference stage, no reference copy on the ranks) trains the same weights bit for bit as
    the step that computes it for the kl metric, and logs no kl."""
    (with_pass, with_metrics), (without, without_metrics) = graphs[3:5]
    assert_same_runs(with_pass, without, ITERATIONS, ITERATIONS + 1, skip_arrays=("ref_logp",))
    store = RolloutStore(without / "rollouts.zarr")
    for step in range(ITERATIONS):
        assert "reference" not in store.attrs(step)["complete"]
        assert not store.read(step, "ref_logp")["ref_logp"].any()  # never written
        assert "reference" in RolloutStore(with_pass / "rollouts.zarr").attrs(step)["complete"]
    for step, (ours, theirs) in enumerate(zip(without_metrics, with_metrics)):
        assert "kl" not in ours and "reference_seconds" not in ours
        assert theirs["kl"] > 0 if step else theirs["kl"] == 0, (step, theirs["kl"])  # v0 is the reference
        assert ours["loss"] == theirs["loss"] and ours["grad_norm"] == theirs["grad_norm"] > 0


def test_no_stage_is_marked_before_the_scores_it_follows(graphs):
    """The scoring gate runs beside the passes after it; every later mark still comes after its
    marks (rollout, reward, advantage), so a resumed step never keeps a pass over rows it then
    generates again."""
    for run_dir, _ in graphs[1:4]:
        store = RolloutStore(run_dir / "rollouts.zarr")
        for step in range(ITERATIONS):
            marks = store.attrs(step)["complete"]
            assert marks[:3] == ["rollout", "reward", "advantage"], (run_dir.name, step, marks)
            assert marks.index("reference") < marks.index("train") < marks.index("publish"), (run_dir.name, marks)


def test_the_stages_inside_others_are_marked_and_measured(graphs):
    (_, separate), (inside_dir, inside), _ = graphs[:3]
    store = RolloutStore(inside_dir / "rollouts.zarr")
    for step in range(ITERATIONS):
        attrs = store.attrs(step)
        marks = attrs["complete"]
        assert {"rollout", "reward", "advantage", "reference", "train", "publish"} <= set(marks)
        assert marks.index("reward") < marks.index("reference") < marks.index("train")
        (reference,) = attrs["results_reference"]  # the output rank's train task, after its pass
        assert reference["reference_seconds"] > 0 and reference["rank"] == 1
        assert all(r["reward_seconds"] > 0 for r in attrs["results_rollout"])
    for ours, theirs in zip(inside, separate):
        # Each stage's own seconds, taken out of its host's: the stages still add up to the step.
        assert ours["reference_seconds"] == ours["reference_compute_seconds"] > 0
        assert 0 < ours["reward_seconds"] < ours["rollout_seconds"] + ours["reward_seconds"]
        assert ours["train_seconds"] > 0 and ours["advantage_seconds"] >= 0
        parts = sum(ours[f"{s}_seconds"] for s in ("rollout", "reward", "reference", "train", "publish"))
        assert parts <= ours["iteration_seconds"] * 1.01
        assert "train_handoff_seconds" not in ours  # no forward-only task before the train tasks
        for key in ("reward_mean", "loss", "kl", "grad_norm", "reward_failed", "completion_length_mean"):
            assert ours[key] == theirs[key], key


def test_the_stored_task_times_tile_each_step_window(graphs):
    """benchmarks/critical_path.py breaks a step's window down from the run folder alone: its
    six parts follow one another (each task starts after the one it waits for ends) and add up to
    the window the run reported, with the separate stages as with the stages inside others; the
    rollout and train parts' own phases add up to them."""
    for run_dir, metrics in graphs[:2]:
        by_step, overlapping = run_parts(run_dir, skip=1)
        assert not overlapping and sorted(by_step) == list(range(1, ITERATIONS)), run_dir.name
        for step, parts in by_step.items():
            assert all(parts[k] >= 0 for k in TILES if k in parts), (run_dir.name, step, parts)
            assert "publish" in parts and "publish_and_hops" not in parts  # the publish task's times are stored
            assert sum(parts[k] for k in TILES if k in parts) == pytest.approx(parts["window"], abs=1e-6)
            assert parts["window"] == pytest.approx(metrics[step]["step_window_seconds"], abs=1e-6)
            rollout = ("rollout_skew", "weight_load", "generate", "score", "rollout_other")
            train = ("train_skew", "before_schedule", "reference", "schedule", "after_schedule")
            assert sum(parts[k] for k in rollout) == pytest.approx(parts["rollout"], abs=1e-6)
            assert sum(parts[k] for k in train) == pytest.approx(parts["train"], abs=1e-6)
            assert parts["generate"] > 0 and parts["schedule"] > 0
            # Scoring and the reference pass are inside the rollout and train tasks only when fused.
            assert (parts["score"] > 0 and parts["reference"] > 0) == (run_dir.name == "inside")
