"""A training rank that fails mid-step ends the iteration with an error naming the stage, the rank
and the cause; the run does not wait on the surviving ranks. ``grpoflow run`` says so in one line
and keeps the traceback in the run folder."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import time

import pytest

from flows.tasks import TRAIN_FAULT_ENV
from flows.worker import TaskFailureInOneLine

pytestmark = pytest.mark.slow

TIMEOUT_S = 5


def test_a_failing_training_rank_fails_the_iteration_naming_it(tmp_path):
    # Pass 0 of every rank is the reference pass, pass 1 the first training step.
    env = {**os.environ, TRAIN_FAULT_ENV: "rank=1,kind=raise,step=1,microbatch=0"}
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "flows.cli", "run", "configs/tiny.yaml", "--quiet", "iterations=1",
                           "run_name=fault", f"runs_dir={tmp_path}", "warmup.steps=30", "task.prompts_per_step=8",
                           "train.micro_batch_size=16", f"train.timeout_s={TIMEOUT_S}"],
                          capture_output=True, text=True, timeout=300, env=env)
    assert time.perf_counter() - t0 < 180  # start-up, rollout and a failed step; never a hang
    assert proc.returncode == 1, proc.stderr[-3000:]
    first, second = proc.stderr.strip().splitlines()[-2:]
    assert first.startswith("grpoflow: step 0: stage train failed: ") and \
        "rank 1 (pp=1, dp=0, tp=0): RuntimeError: injected fault" in first, proc.stderr[-3000:]
    error_file = tmp_path / "fault" / "error.txt"
    assert second == (f"the traceback is in {error_file}; the same command resumes the run from the stages it "
                      "completed")
    # the traceback, the worker's included, is in the file, not on the terminal
    text = error_file.read_text()
    assert text.startswith("Traceback") and "flows/tasks.py" in text and "injected fault" in text
    assert "Traceback" not in proc.stderr and "Compute Failed" not in proc.stderr, proc.stderr[-3000:]
    assert "failed: TrainStepError" in proc.stderr  # the worker's one line


def test_a_worker_s_failed_task_record_is_one_warning_line():
    # As distributed/worker.py logs it: key, state, task repr, exception text, traceback text.
    record = logging.LogRecord("distributed.worker", logging.ERROR, "worker.py", 1,
                               "Compute Failed\nKey:       %s\nState:     %s\nTask:  %s\nException: %r\n"
                               "Traceback: %r\n", ("train-0-1-abc", "executing", "<Task ...>",
                                                   "ValueError('loss is nan')", "  File ..."), None)
    assert TaskFailureInOneLine().filter(record)
    assert (record.levelname, record.getMessage()) == ("WARNING", "task train-0-1-abc failed: ValueError('loss is nan')")
    other = logging.LogRecord("distributed.worker", logging.ERROR, "worker.py", 1, "something else %s", ("x",), None)
    assert TaskFailureInOneLine().filter(other) and other.getMessage() == "something else x"
    assert any(isinstance(f, TaskFailureInOneLine) for f in logging.getLogger("distributed.worker").filters)
