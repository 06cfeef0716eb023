"""The eval stage: a run with eval on trains bit for bit what the run without it trains; each due
version's held-out rows and metrics are stored, logged to MLflow with the version as step and
written to summary.json; evaluating a stored version again (``grpoflow eval``'s code path) gives
the same rows."""

from __future__ import annotations

import json
import shutil
from dataclasses import replace
from pathlib import Path

import mlflow
import numpy as np
import pytest

from conftest import assert_same_runs
from flows.cluster import start_cluster
from flows.config import load_config
from flows.evaluate import eval_config_hash, evaluate_version
from flows.loop import run, run_folder
from stages.tasks.addition import make_prompts

pytestmark = pytest.mark.slow

ITERATIONS = 2
_RESUMED: dict = {}  # the eval run resumed for one more step


def _heldout(path: Path) -> Path:
    # Operands from a stream no GRPO step draws from (seed 99); a tiny policy gets some right.
    rows = [{"prompt": p, "answer": str(eval(p[:-1]))} for p in make_prompts(99, 0, 24, 2)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("eval")
    heldout = _heldout(root / "heldout.jsonl")
    base = load_config("configs/tiny.yaml", [
        f"iterations={ITERATIONS}", "warmup.steps=100", "task.prompts_per_step=8", "train.micro_batch_size=16",
        f"runs_dir={root / 'plain'}"])
    with_eval = replace(base, runs_dir=str(root / "eval"), eval=replace(
        base.eval, path=str(heldout), every_steps=1, num_samples=4, ks=[1, 2, 4]))
    client, cluster = start_cluster(with_eval)  # the tiny cluster and an eval worker
    try:
        at = replace(base.cluster, scheduler_address=cluster.scheduler_address)
        plain = run(replace(base, cluster=at), progress=False)
        evaluated = run(replace(with_eval, cluster=at), progress=False)
        # The same run resumed for one more step, in a copy: v0..v2 are stored and logged already.
        resumed = replace(with_eval, runs_dir=str(root / "resumed"), cluster=at)
        shutil.copytree(root / "eval", root / "resumed")
        _RESUMED["summary"] = run(replace(resumed, iterations=ITERATIONS + 1), progress=False)
        yield base, with_eval, plain, evaluated
    finally:
        client.close()
        cluster.close()


def test_training_with_eval_equals_training_without(runs):
    base, with_eval, *_ = runs
    assert_same_runs(Path(run_folder(base).root), Path(run_folder(with_eval).root), ITERATIONS, ITERATIONS + 1)


def test_evaluations_run_on_the_eval_worker_only(runs):
    """The embedded cluster's eval worker takes every evaluation, so none holds back a step's
    gates (plain worker) or a rank (training workers)."""
    import zarr

    _, with_eval, _, _ = runs
    root = run_folder(with_eval).evals
    assert [zarr.open_group(f"{root}/v{v}", mode="r").attrs["worker"] for v in (0, 1, 2)] == ["eval-0"] * 3


def test_every_version_is_evaluated_stored_and_logged(runs):
    _, with_eval, plain, evaluated = runs
    assert plain.eval == {}
    assert sorted(evaluated.eval) == [0, 1, 2]
    for m in evaluated.eval.values():
        assert m["eval_prompts"] == 24
        assert 0 <= m["eval_greedy_accuracy"] <= 1 and 0 <= m["eval_accuracy"] <= m["eval_pass_at_4"] <= 1
        assert m["eval_pass_at_1"] == m["eval_accuracy"]
    folder = run_folder(with_eval)
    summary = json.loads(Path(folder.summary).read_text())
    assert summary["eval"] == {str(v): m for v, m in evaluated.eval.items()}
    rows = folder.eval_store().read(1)
    assert len(rows["correct"]) == 24 * (1 + 4) and rows["greedy"].sum() == 24
    # Stored rows give the stored metric.
    assert rows["correct"][rows["greedy"]].mean() == pytest.approx(evaluated.eval[1]["eval_greedy_accuracy"])
    history = mlflow.MlflowClient(evaluated.tracking_uri).get_metric_history(evaluated.mlflow_run_id,
                                                                             "grpo/eval_greedy_accuracy")
    assert sorted((h.step, h.value) for h in history) == [(v, evaluated.eval[v]["eval_greedy_accuracy"])
                                                          for v in (0, 1, 2)]


def test_evaluating_a_version_again_gives_the_same_rows(runs, tmp_path):
    _, with_eval, _, evaluated = runs
    folder = run_folder(with_eval)
    stored = folder.eval_store().read(2)
    # A fresh eval store: the version is generated and scored again, in this process.
    again = replace(with_eval, runs_dir=str(tmp_path))
    other = run_folder(again).create()
    policy = folder.policy_store().ref(2)
    metrics = evaluate_version(again, other, policy)
    fresh = other.eval_store().read(2)
    for name in stored:
        np.testing.assert_array_equal(stored[name], fresh[name], err_msg=name)
    assert {k: v for k, v in metrics.items() if k != "eval_seconds"} == \
        {k: v for k, v in evaluated.eval[2].items() if k != "eval_seconds"}
    # Stored under the same eval config: returned as stored, not generated again.
    assert other.eval_store().metrics(2, eval_config_hash(again), policy.sha256) == metrics


def test_grpoflow_eval_on_a_moved_run_folder_recomputes_the_stored_metrics(runs, tmp_path, capsys):
    import shutil

    from flows.cli import main

    _, with_eval, _, evaluated = runs
    moved = tmp_path / "elsewhere" / "renamed"
    shutil.copytree(run_folder(with_eval).root, moved)
    shutil.rmtree(moved / "eval.zarr")
    assert main(["eval", str(moved), "--version", "1", "--version", "2"]) == 0
    out = capsys.readouterr().out
    assert "eval v1: greedy_accuracy" in out and str(moved / "eval.zarr") in out
    from storage.evals import EvalStore

    again = EvalStore(moved / "eval.zarr").all_metrics()
    assert sorted(again) == [1, 2]
    for v in (1, 2):
        assert {k: m for k, m in again[v].items() if k != "eval_seconds"} == \
            {k: m for k, m in evaluated.eval[v].items() if k != "eval_seconds"}


def test_grpoflow_eval_refuses_in_one_line(runs, tmp_path, capsys):
    from flows.cli import main

    _, with_eval, _, _ = runs
    root = run_folder(with_eval).root
    cases = [([root, "eval.path=null"], "eval.path is unset"),
             ([root, "--version", "9"], "no complete policy v9"),
             ([str(tmp_path)], "holds no run.json")]
    for argv, message in cases:
        assert main(["eval", *argv]) == 2
        err = capsys.readouterr().err.strip()
        assert message in err and "\n" not in err, err


def test_the_eval_curve_is_drawn_and_logged(runs):
    _, with_eval, _, evaluated = runs
    plot = Path(run_folder(with_eval).plots) / "eval.png"
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    logged = mlflow.MlflowClient(evaluated.tracking_uri).list_artifacts(evaluated.mlflow_run_id, "plots")
    assert "plots/eval.png" in {a.path for a in logged}


def test_a_resumed_run_evaluates_and_logs_only_the_new_version(runs):
    _, _, _, evaluated = runs
    resumed = _RESUMED["summary"]
    assert sorted(resumed.eval) == [0, 1, 2, 3]
    assert all(resumed.eval[v] == evaluated.eval[v] for v in (0, 1, 2))  # stored, not evaluated again
    history = mlflow.MlflowClient(resumed.tracking_uri).get_metric_history(resumed.mlflow_run_id, "eval_seconds")
    assert sorted(h.step for h in history) == [0, 1, 2, 3]  # each version once on the continued parent run
