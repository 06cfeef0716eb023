"""MLflow lineage against a real sqlite tracking store: what the UI will find there."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import yaml

import mlflow

from conftest import log_finished_step  # noqa: E402
from flows.background import BackgroundQueue  # noqa: E402
from storage.lineage import (EXPERIMENT_KIND_TAG, Lineage, experiment_page, git_commit, iteration_runs,  # noqa: E402
                             relocate_artifacts, ui_command)

CONFIG = {"run_name": "t", "train": {"schedule": "1f1b", "lr": 7e-4}, "reward": {"functions": ("exact_match",)}}


@pytest.fixture(scope="module")
def lineage(tmp_path_factory) -> Lineage:
    root = tmp_path_factory.mktemp("mlflow")
    return Lineage(f"sqlite:///{root / 'mlflow.db'}", "grpoflow", "t", CONFIG, tags={"grpoflow.config_hash": "abc"},
                   artifact_location=str(root / "mlartifacts"))


def test_experiment_opens_in_the_training_view(lineage):
    exp = lineage.client.get_experiment(lineage.experiment_id)
    # The values of the UI's ExperimentKind enum (mlflow/server/js): "custom_model_development" is
    # "Machine learning", "genai_development" the GenAI page.
    assert exp.tags[EXPERIMENT_KIND_TAG] == "custom_model_development"
    page = experiment_page(lineage.tracking_uri, "grpoflow")
    assert page == f"#/experiments/{lineage.experiment_id}/runs?workflowType=machine_learning"
    assert experiment_page(lineage.tracking_uri) == page  # found by its tag when no name is given
    assert experiment_page(lineage.tracking_uri, "no-such-experiment") is None


def test_parent_carries_config_yaml_and_git_commit(lineage, tmp_path):
    run = lineage.client.get_run(lineage.run_id)
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=Path(__file__).parent, capture_output=True, text=True)
    assert run.data.tags["mlflow.source.git.commit"] == (head.stdout.strip() if head.returncode == 0 else "unknown")
    assert run.data.params["train.schedule"] == "1f1b"
    local = lineage.client.download_artifacts(lineage.run_id, "config.yaml", str(tmp_path))
    assert yaml.safe_load(Path(local).read_text()) == {
        "run_name": "t", "train": {"schedule": "1f1b", "lr": 7e-4}, "reward": {"functions": ["exact_match"]}}


def test_git_commit_outside_a_checkout_is_unknown(tmp_path):
    assert git_commit(tmp_path) == "unknown"


def test_child_run_spans_the_step_and_records_versions(lineage):
    before_ms = time.time() * 1000
    handle = lineage.start_step(0, policy_version_in=0)
    assert lineage.client.get_run(handle.run_id).info.status == "RUNNING"
    time.sleep(0.5)  # the step's work
    handle.log_metrics({"reward_mean": 0.25, "loss": 1.5})
    handle.log_policy(1, "/p/v1", "f" * 64)
    handle.end()
    after_ms = time.time() * 1000
    run = lineage.client.get_run(handle.run_id)
    assert run.info.status == "FINISHED"
    assert before_ms - 5 <= run.info.start_time and run.info.end_time <= after_ms + 5
    assert run.info.end_time - run.info.start_time >= 500
    assert run.data.tags["policy.version_in"] == "0" and run.data.tags["policy.version_out"] == "1"
    assert run.data.tags["mlflow.parentRunId"] == lineage.run_id
    assert run.data.metrics == {"reward_mean": 0.25, "loss": 1.5}
    # On the parent the main curves form the "grpo" section, drawn first.
    parent = lineage.client.get_metric_history(lineage.run_id, "grpo/reward_mean")
    assert [(m.step, m.value) for m in parent] == [(0, 0.25)]
    assert lineage.client.get_metric_history(lineage.run_id, "reward_mean") == []


def test_failed_step_ends_failed(lineage):
    with pytest.raises(RuntimeError):
        with lineage.start_step(7, policy_version_in=3) as handle:
            raise RuntimeError("stage train failed")
    assert lineage.client.get_run(handle.run_id).info.status == "FAILED"


def test_rollout_dataset_carries_the_array_schema(lineage):
    arrays = {"tokens": ("int32", (64, 6)), "reward": ("float32", (64,))}
    with lineage.start_step(1, policy_version_in=1) as handle:
        handle.log_rollouts("/r/rollouts.zarr/step_1", "0123456789abcdef", arrays)
    run = lineage.client.get_run(handle.run_id)
    (inp,) = run.inputs.dataset_inputs
    assert inp.dataset.source_type == "zarr" and inp.dataset.digest == "0123456789abcdef"
    assert [t.value for t in inp.tags] == ["training"]
    specs = {c["name"]: c for c in json.loads(inp.dataset.schema)["mlflow_colspec"]}
    assert specs["tokens"]["type"] == "tensor" and specs["tokens"]["tensor-spec"] == {"dtype": "int32", "shape": [-1, 6]}
    assert specs["reward"]["tensor-spec"] == {"dtype": "float32", "shape": [-1]}


def test_samples_table_and_plots(lineage, tmp_path):
    table = {"id": ["step=2/group=0/sample=0", "step=2/group=0/sample=1"], "prompt": ["12+34=", "12+34="],
             "completion": ["46", "47"], "reward": [1.0, 0.0], "advantage": [0.7071, -0.7071],
             "policy_version": [2, 2]}
    with lineage.start_step(2, policy_version_in=2) as handle:
        handle.log_samples(table)
    run = lineage.client.get_run(handle.run_id)
    assert json.loads(run.data.tags["mlflow.loggedArtifacts"]) == [{"path": "samples/step_2.json", "type": "table"}]
    # The file as the UI reads it (pandas' load_table would turn "46" into a number).
    stored = json.loads(Path(lineage.client.download_artifacts(handle.run_id, "samples/step_2.json",
                                                               str(tmp_path))).read_text())
    assert stored["columns"] == list(table)
    assert [row[2] for row in stored["data"]] == ["46", "47"] and [row[3] for row in stored["data"]] == [1.0, 0.0]
    # A resumed step logs its table again into the reopened child run: it replaces the rows.
    with lineage.start_step(2, policy_version_in=2) as again:
        again.log_samples({**table, "reward": [float("nan"), 0.0]})
    assert again.run_id == handle.run_id
    stored = json.loads(Path(lineage.client.download_artifacts(handle.run_id, "samples/step_2.json",
                                                               str(tmp_path / "again"))).read_text())
    assert len(stored["data"]) == 2 and [row[3] for row in stored["data"]] == [None, 0.0]  # NaN as JSON null
    assert lineage.client.load_table(lineage.experiment_id, "samples/step_2.json", [handle.run_id]).shape == (2, len(table))
    png = tmp_path / "reward.png"
    png.write_bytes(b"\x89PNG first")
    lineage.log_plots([png])
    png.write_bytes(b"\x89PNG second")
    lineage.log_plots([png])  # a refresh replaces the file of the same name
    assert [a.path for a in lineage.client.list_artifacts(lineage.run_id, "plots")] == ["plots/reward.png"]
    got = lineage.client.download_artifacts(lineage.run_id, "plots/reward.png", str(tmp_path / "dl"))
    assert Path(got).read_bytes() == b"\x89PNG second"


def test_a_step_run_ends_finished_with_its_versions(lineage):
    cid = log_finished_step(lineage, 5, {"reward_mean": 0.5}, 6)
    run = lineage.client.get_run(cid)
    assert run.info.status == "FINISHED" and run.data.tags["policy.version_out"] == "6"
    assert run.data.tags["policy.version_in"] == "5"
    steps = list(iteration_runs(lineage.tracking_uri, lineage.run_id)["tags.grpoflow.step"])
    assert steps == sorted(steps, key=int) and "5" in steps


def test_ui_command_runs_one_worker_on_loopback():
    cmd = ui_command("sqlite:////x/mlflow.db", 5123)
    assert cmd[1:4] == ["-m", "mlflow", "ui"]
    assert cmd[cmd.index("--workers") + 1] == "1" and cmd[cmd.index("--host") + 1] == "127.0.0.1"
    assert cmd[cmd.index("--port") + 1] == "5123"


def test_background_queue_runs_calls_in_order_and_raises_the_first_error():
    queue = BackgroundQueue(max_pending=2)
    done = []

    def slow(i):
        time.sleep(0.02)
        done.append(i)
        return i

    futures = [queue.submit(slow, i) for i in range(5)]
    assert len(queue._pending) <= 2  # a further submit waited for the oldest
    queue.drain()
    assert done == [0, 1, 2, 3, 4] and [f.result() for f in futures] == [0, 1, 2, 3, 4]

    def fail():
        raise RuntimeError("sqlite store is read-only")

    queue.submit(fail)
    queue.submit(slow, 5)  # still runs: the error is raised to the loop, not swallowed by the thread
    with pytest.raises(RuntimeError, match="read-only"):
        queue.drain()
    queue.drain()
    assert done[-1] == 5
    queue.submit(fail)
    queue.close()  # a failing run: queued errors are logged, not raised again
    with pytest.raises(ValueError, match="max_pending"):
        BackgroundQueue(max_pending=0)


@pytest.mark.skipif(sys.platform != "linux", reason="per-thread niceness is Linux's")
def test_background_queue_thread_yields_the_cpu():
    queue = BackgroundQueue(niceness=19)
    own = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    worker = queue.submit(lambda: os.getpriority(os.PRIO_PROCESS, threading.get_native_id())).result()
    queue.close()
    assert worker == 19  # raising one's own niceness needs no privilege
    assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == own  # the caller's is untouched


def test_a_copied_folder_s_store_is_pointed_at_its_own_artifacts(tmp_path):
    import shutil

    a, b = tmp_path / "a" / "run", tmp_path / "b" / "run_2"
    a.mkdir(parents=True)
    note = tmp_path / "note.txt"
    note.write_text("x")
    made = Lineage(f"sqlite:///{a / 'mlflow.db'}", "grpoflow", "run", CONFIG, artifact_location=str(a / "mlartifacts"))
    made.log_artifact(made.run_id, str(note))
    assert relocate_artifacts(a / "mlflow.db", str(a / "mlartifacts")) is None  # in place: nothing to do
    shutil.copytree(a, b)
    original = (a / "mlflow.db").read_bytes()
    assert relocate_artifacts(b / "mlflow.db", str(b / "mlartifacts")) == str(a / "mlartifacts")
    assert relocate_artifacts(b / "mlflow.db", str(b / "mlartifacts")) is None
    assert (a / "mlflow.db").read_bytes() == original
    client = mlflow.tracking.MlflowClient(f"sqlite:///{b / 'mlflow.db'}")
    assert client.get_experiment_by_name("grpoflow").artifact_location == str(b / "mlartifacts")
    run = client.get_run(made.run_id)
    assert run.info.artifact_uri == f"{b}/mlartifacts/{made.run_id}/artifacts"
    assert [f.path for f in client.list_artifacts(made.run_id)] == ["config.yaml", "note.txt"]
    assert relocate_artifacts(tmp_path / "none.db", "x") is None


def test_a_database_error_mlflow_reraises_is_not_also_logged_with_its_traceback(tmp_path, caplog):
    """mlflow.store.db.utils logs an OperationalError (e.g. SQLite's "database or disk is full")
    with its traceback before re-raising it as an MlflowException; with storage.lineage imported only
    the raised error is left, for the CLI's one-line report. Its other records still pass."""
    import logging

    import sqlalchemy
    from mlflow.exceptions import MlflowException
    from mlflow.store.db.utils import _get_managed_session_maker
    from sqlalchemy.orm import sessionmaker

    engine = sqlalchemy.create_engine(f"sqlite:///{tmp_path / 'mlflow.db'}")
    managed = _get_managed_session_maker(sessionmaker(bind=engine), "sqlite")
    caplog.set_level(logging.DEBUG)
    with pytest.raises(MlflowException, match="database or disk is full"):
        with managed(read_only=False):
            raise sqlalchemy.exc.OperationalError("INSERT INTO params", {}, Exception("database or disk is full"))
    assert not [r for r in caplog.records if r.name == "mlflow.store.db.utils"], caplog.text
    logging.getLogger("mlflow.store.db.utils").error("another error")
    assert [r.getMessage() for r in caplog.records if r.name == "mlflow.store.db.utils"] == ["another error"]
