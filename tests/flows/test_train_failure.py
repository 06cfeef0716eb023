"""A training rank that fails mid-step ends the iteration with an error naming the stage, the rank
and the cause; the run does not wait on the surviving ranks."""

from __future__ import annotations

import time

import pytest

from flows.config import load_config
from flows.iteration import IterationError
from flows.loop import run
from flows.tasks import TRAIN_FAULT_ENV

pytestmark = pytest.mark.slow

TIMEOUT_S = 5


def test_a_failing_training_rank_fails_the_iteration_naming_it(tmp_path, monkeypatch):
    # Pass 0 of every rank is the reference pass, pass 1 the first training step.
    monkeypatch.setenv(TRAIN_FAULT_ENV, "rank=1,kind=raise,step=1,microbatch=0")
    cfg = load_config("configs/tiny.yaml", [
        "iterations=1", "run_name=fault", f"runs_dir={tmp_path}", "warmup.steps=30", "task.prompts_per_step=8",
        "train.micro_batch_size=16", f"train.timeout_s={TIMEOUT_S}"])
    t0 = time.perf_counter()
    with pytest.raises(IterationError) as info:
        run(cfg, progress=False)
    message = str(info.value)
    assert "step 0: stage train failed" in message
    assert "rank 1 (pp=1, dp=0, tp=0): RuntimeError: injected fault" in message
    assert time.perf_counter() - t0 < 180  # start-up, rollout and a failed step; never a hang
