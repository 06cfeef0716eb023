"""Two GRPO iterations through a real embedded Dask cluster, and what they leave behind."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
import transformers  # a test dependency: the published policy must load into it
import zarr

from flows.config import load_config
from flows.iteration import STAGES as LOOP_STAGES
from flows.loop import format_summary, run
from storage.lineage import iteration_runs
from storage.plots import save_run_plots
from storage.policies import PolicyStore
from storage.rollouts import RolloutStore

pytestmark = pytest.mark.slow

STAGES = {"rollout", "reward", "reference", "advantage", "train", "publish"}


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory):
    runs_dir = tmp_path_factory.mktemp("runs")
    cfg = load_config("configs/tiny.yaml", [
        "iterations=2", "run_name=e2e", f"runs_dir={runs_dir}", "warmup.steps=30",
        "task.prompts_per_step=8", "train.micro_batch_size=16"])
    summary = run(cfg, progress=False)
    return cfg, summary, runs_dir / "e2e"


def test_summary_json(finished_run):
    cfg, summary, run_dir = finished_run
    data = json.loads((run_dir / "summary.json").read_text())
    assert data["run_name"] == "e2e" and data["iterations"] == 2
    assert len(data["reward_mean"]) == 2 and all(0.0 <= r <= 1.0 for r in data["reward_mean"])
    assert data["mlflow_run_id"] == summary.mlflow_run_id
    assert set(data["stage_seconds"]) == {"rollout", "reward", "reference", "advantage", "train", "publish"}
    assert data["wall_seconds"] > 0
    for m in data["metrics"]:  # the planner's host terms (planner/async_steptime.py)
        assert 0 < m["host_cpu_seconds"]
        if cfg.train.reference_pass == "separate":  # the ranks' wait from their reference task to their train task
            assert 0 <= m["train_handoff_seconds"] < m["iteration_seconds"]
        else:  # the train task runs the pass: no task before it to wait from
            assert "train_handoff_seconds" not in m
        # Model FLOPs of each phase from the stored lengths (stages/perf), over the host's matmul rate.
        assert m["model_flops_train"] == pytest.approx(3 * m["model_flops_reference"]) and m["model_flops_rollout"] > 0
        for key in ("mfu", "mfu_rollout", "mfu_train"):
            assert 0 < m[key] < 1, (key, m[key])


def test_rollout_store_holds_complete_group_aligned_steps(finished_run):
    cfg, _, run_dir = finished_run
    store = RolloutStore(run_dir / "rollouts.zarr")
    assert store.steps() == [0, 1]
    G = cfg.rollout.group_size
    for step in (0, 1):
        attrs = store.attrs(step)
        assert STAGES <= set(attrs["complete"])
        assert attrs["group_size"] == G and attrs["policy_version"] == step
        assert attrs["next_policy_version"] == step + 1
        assert attrs["chunk_samples"] % G == 0
        rows = store.read(step, "group_id", "policy_version", "reward", "advantage", "ref_logp", "length")
        assert np.all(rows["policy_version"] == step)
        groups = rows["group_id"].reshape(-1, G)
        assert np.all(groups == groups[:, :1])  # the G rows of a group are contiguous
        adv = rows["advantage"].reshape(-1, G)
        np.testing.assert_allclose(adv.mean(axis=1), 0.0, atol=1e-5)
        mask = np.arange(rows["ref_logp"].shape[1]) < rows["length"][:, None]
        assert np.all(rows["ref_logp"][mask] < 0) and np.all(rows["ref_logp"][~mask] == 0)


def test_mlflow_lineage(finished_run):
    _, summary, _ = finished_run
    runs = iteration_runs(summary.tracking_uri, summary.mlflow_run_id)
    assert list(runs["tags.grpoflow.step"]) == ["0", "1"]
    for column in ("metrics.reward_mean", "metrics.loss", "metrics.kl", "metrics.clip_fraction",
                   "metrics.bubble_fraction", "metrics.rollout_seconds", "metrics.rollout_tokens_per_s"):
        assert runs[column].notna().all(), column
    assert list(runs["tags.policy.version"]) == ["1", "2"]
    assert runs["params.train.schedule"].iloc[0] == "1f1b"
    import mlflow

    client = mlflow.MlflowClient(summary.tracking_uri)
    # Each child run spans its step's own work: from its first task to the step's end, so the
    # synchronous run's children follow each other instead of overlapping by a step.
    spans = [(client.get_run(r).info.start_time, client.get_run(r).info.end_time) for r in runs["run_id"]]
    for (start, end), m in zip(spans, summary.metrics):
        assert 0 < end - start <= 1000 * m["iteration_seconds"] + 50, (end - start, m["iteration_seconds"])
    assert spans[1][0] >= spans[0][1] - 50, spans
    assert list(runs["tags.policy.path"]) == ["policy/v1", "policy/v2"]  # relative to the run folder
    run = client.get_run(runs["run_id"].iloc[1])
    (dataset,) = [d.dataset for d in run.inputs.dataset_inputs]
    assert dataset.source_type == "zarr" and "step_1" in dataset.source and len(dataset.digest) == 16


def test_published_policy_loads_into_transformers(finished_run):
    _, summary, run_dir = finished_run
    path = Path(summary.policy_path)
    assert path == run_dir.resolve() / "policy" / "v2"
    model = transformers.AutoModelForCausalLM.from_pretrained(path)
    from stages.policy import build_stage, load_hf_state
    from stages.policy.model import DecoderConfig
    from storage.policies import load_model_folder

    hf_config, _, tensors = load_model_folder(path)
    ours = build_stage(DecoderConfig.from_hf(hf_config))
    load_hf_state(ours, tensors)
    ids = torch.tensor([[1, 4, 5, 13, 6, 7, 14]])
    torch.testing.assert_close(ours(ids), model(ids).logits, atol=1e-4, rtol=1e-4)


def test_timeline_has_forward_and_backward_per_rank(finished_run):
    cfg, _, run_dir = finished_run
    trace = json.loads((run_dir / "timelines" / "step_1.json").read_text())
    events = [e for e in trace["traceEvents"] if e.get("cat") in ("F", "B")]
    m = cfg.num_microbatches
    for rank in (0, 1):
        kinds = [e["cat"] for e in events if e["pid"] == rank]
        assert kinds.count("F") == m and kinds.count("B") == m


def test_rerun_resumes_after_the_last_published_step(finished_run, tmp_path):
    cfg, summary, run_dir = finished_run
    # A crash between train and publish of step 1: every shard of v2 is on disk (train is marked),
    # v2's manifest and step 1's publish mark are not.
    store, policies = RolloutStore(run_dir / "rollouts.zarr"), PolicyStore(run_dir / "policy")
    sha_v2 = policies.ref(2).sha256
    (run_dir / "policy" / "v2" / "grpoflow.json").unlink()
    group = zarr.open_group(store.ref(1).path, mode="r+")
    group.attrs["complete"] = [s for s in group.attrs["complete"] if s != "publish"]
    more = load_config("configs/tiny.yaml", [
        "iterations=3", "run_name=e2e", f"runs_dir={run_dir.parent}", "warmup.steps=30",
        "task.prompts_per_step=8", "train.micro_batch_size=16"])
    resumed = run(more, progress=False)
    assert [m["step"] for m in resumed.metrics] == [0, 1, 2]  # summary.json covers every step of the run
    # Step 1 was not trained again: its training results are the ones stored with its train mark.
    assert resumed.metrics[1]["loss"] == summary.metrics[1]["loss"] and "loss" in resumed.metrics[2]
    assert policies.ref(2).sha256 == sha_v2  # v2 published from the shards step 1 wrote
    assert store.attrs(2)["policy_version"] == 2 and STAGES <= store.completed(2)
    assert policies.is_complete(3)
    # The closing line and the plots cover the earlier process's step too, not only this one's.
    assert resumed.first_step_here == 1
    assert format_summary(resumed).splitlines()[0].startswith("run e2e: 3 iterations, 2 of them (from step 1) in")
    drawn = (run_dir / "plots" / "reward.png").read_bytes()
    assert save_run_plots(resumed.metrics, tmp_path / "all", LOOP_STAGES)[0].read_bytes() == drawn
    assert save_run_plots(resumed.metrics[1:], tmp_path / "here", LOOP_STAGES)[0].read_bytes() != drawn
