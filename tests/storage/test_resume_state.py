"""The run-level state a resumed run reads: run.json in the run folder, and the MLflow parent run
it continues."""

from __future__ import annotations

import pytest

from conftest import log_finished_step
from storage.lineage import Lineage, iteration_runs
from storage.run_folder import RunFolder, RunFolderError


def test_run_state_round_trip_and_errors(tmp_path):
    folder = RunFolder.at(tmp_path, "r").create()
    assert folder.load_run_state() is None and not folder.exists()
    folder.save_run_state({"config": {"seed": 1}, "config_hash": "ab", "mlflow_run_id": "x"})
    assert folder.load_run_state() == {"config": {"seed": 1}, "config_hash": "ab", "mlflow_run_id": "x"}
    assert folder.exists()
    open(folder.run_state, "w").write("{")
    with pytest.raises(RunFolderError, match=r"cannot read .*run.json.*--new"):
        folder.load_run_state()


def test_a_resumed_lineage_continues_the_parent_run(tmp_path):
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    first = Lineage(uri, "exp", "r", {"seed": 0}, artifact_location=str(tmp_path / "art"))
    log_finished_step(first, 0, {"loss": 1.0}, 1)
    first.finish("FAILED")  # a crashed run
    again = Lineage(uri, "exp", "r", {"seed": 0}, run_id=first.run_id)
    assert again.run_id == first.run_id
    assert again.client.get_run(first.run_id).info.status == "RUNNING"
    log_finished_step(again, 1, {"loss": 0.5}, 2)
    again.finish()
    runs = iteration_runs(uri, first.run_id)
    assert list(runs["tags.grpoflow.step"]) == ["0", "1"]
    assert list(runs["metrics.loss"]) == [1.0, 0.5]
    assert again.client.get_run(first.run_id).info.status == "FINISHED"
    assert len(again.client.search_runs([again.experiment_id], "tags.mlflow.runName = 'r'")) == 1
