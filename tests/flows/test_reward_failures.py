"""A reward that fails on every sample speaks: each step logs the count and the first reason, the
step's MLflow child run carries it (per reward function too), and the run stops after reward.max_failed_steps such steps
instead of training nothing to the end."""

from __future__ import annotations

import logging

import mlflow
import pytest

from flows.config import load_config
from flows.iteration import IterationError
from flows.loop import run, run_folder, tracking_uri

pytestmark = pytest.mark.slow

REASON = "tests.flows.nonfinite_rewards:raising_reward: RuntimeError: the grader is broken"


def test_a_reward_failing_everywhere_stops_the_run_saying_why(tmp_path, caplog):
    cfg = load_config("configs/tiny.yaml", [
        f"runs_dir={tmp_path}", "iterations=5", "warmup.steps=20", "task.prompts_per_step=8",
        "train.micro_batch_size=16", "reward.functions=[exact_match,tests.flows.nonfinite_rewards:raising_reward]",
        "reward.max_failed_steps=2"])
    with caplog.at_level(logging.WARNING, logger="flows"):
        with pytest.raises(IterationError) as info:
            run(cfg, progress=False)
    message = str(info.value)
    assert "every sample's reward failed in steps 0-1 (reward.max_failed_steps=2)" in message
    assert REASON in message and "\n" not in message
    # Told per function: exact_match scored every sample, raising_reward failed every one.
    assert f"step 0: 64 of 64 rewards failed; raising_reward failed 64: {REASON}" in caplog.text
    # The steps ran are logged, each child run tagged with the reason.
    client = mlflow.MlflowClient(tracking_uri(cfg))
    children = client.search_runs(client.get_experiment_by_name(cfg.mlflow.experiment).experiment_id,
                                  filter_string="tags.`grpoflow.step` = '0'")
    assert children and children[0].data.tags["reward.first_error"] == REASON
    tags, metrics = children[0].data.tags, children[0].data.metrics
    assert tags["reward.raising_reward.first_error"] == REASON and "reward.exact_match.first_error" not in tags
    assert metrics["reward_failed/raising_reward"] == 64 and metrics["reward_failed/exact_match"] == 0
    assert 0 <= metrics["reward/exact_match"] <= 1 and metrics["reward_failed"] == 64
    # Stopped at step 1's end: at most the step already in flight behind it (2) finished, never the last.
    assert not run_folder(cfg).policy_store().is_complete(4)
