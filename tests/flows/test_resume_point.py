"""Where a rerun starts: after the last step that is published and logged, its metrics stored
with its "lineage" mark (summary.json is built from them); a step whose mark lacks them is rerun,
and a summary that would miss a step's metrics names the step instead of raising a KeyError."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from flows.config import config_hash, load_config
from flows.iteration import IterationError, step_layout
from flows.loop import _resume_point, _summarise, run_folder

DONE = ["rollout", "reward", "advantage", "reference", "train", "publish"]


@pytest.fixture
def folder_with_steps(tmp_path):
    """A tiny run folder with steps 0-2 stored and versions v0-v3 complete; no step marked."""
    cfg = load_config("configs/tiny.yaml", ["iterations=3", f"runs_dir={tmp_path}", "run_name=r"])
    folder = run_folder(cfg).create()
    store, policies = folder.rollout_store(), folder.policy_store()
    for step in range(3):
        store.create_step(step, step_layout(cfg), step, config_hash(cfg))
    for v in range(4):
        policies.version_path(v).mkdir(parents=True)
        (policies.version_path(v) / "grpoflow.json").write_text('{"sha256": "0", "num_bytes": 0}')
    return cfg, folder, store


def test_a_rerun_starts_after_the_last_logged_step(folder_with_steps):
    cfg, folder, store = folder_with_steps
    store.mark_complete(0, (*DONE, "lineage"), metrics={"loss": 1.0})
    store.mark_complete(1, (*DONE, "lineage"), metrics={"loss": 2.0})
    store.mark_complete(2, tuple(DONE))
    assert _resume_point(cfg, folder) == (2, 2)


def test_a_lineage_mark_without_metrics_is_rerun(folder_with_steps):
    cfg, folder, store = folder_with_steps
    store.mark_complete(0, (*DONE, "lineage"), metrics={"loss": 1.0})
    store.mark_complete(1, (*DONE, "lineage"))  # no metrics: summary.json could not report the step
    store.mark_complete(2, (*DONE, "lineage"), metrics={"loss": 3.0})
    assert _resume_point(cfg, folder) == (1, 1)


def test_a_summary_missing_a_steps_metrics_names_the_step(folder_with_steps):
    cfg, folder, store = folder_with_steps
    store.mark_complete(0, (*DONE, "lineage"), metrics={"loss": 1.0})
    store.mark_complete(1, tuple(DONE))
    with pytest.raises(IterationError, match=r"step 1 of .* has no stored metrics \(marks: rollout, .*publish\)"):
        _summarise(cfg, None, "", folder, [], 0.0)


def test_a_step_this_process_ran_is_summarised_from_what_it_measured(folder_with_steps, caplog):
    cfg, folder, store = folder_with_steps
    for step in range(2):
        store.mark_complete(step, (*DONE, "lineage"), metrics={"loss": float(step), "lineage_seconds": 0.5})
    store.mark_complete(2, tuple(DONE))  # its lineage mark lost after this process logged the step
    ran = [SimpleNamespace(step=1, metrics={"loss": 10.0}), SimpleNamespace(step=2, metrics={"loss": 20.0})]
    summary = _summarise(cfg, SimpleNamespace(run_id="r"), "", folder, ran, 0.0)
    assert [(m["loss"], m.get("lineage_seconds")) for m in summary.metrics] == [(0.0, 0.5), (10.0, 0.5), (20.0, None)]
    assert "step 2 of" in caplog.text and "lost its stored metrics" in caplog.text
