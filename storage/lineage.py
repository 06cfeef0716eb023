"""MLflow lineage: the only module that calls MLflow.

One parent run per ``grpoflow run``, in an experiment tagged for MLflow's training (classic ML)
view. The parent carries the resolved config (params and ``config.yaml``), the git commit, the
per-step curves and the run's plots (``plots/*.png``, refreshed while the run goes). Each step is a
child run that starts when the step starts and ends when it ends (:meth:`Lineage.start_step`),
with the step's metrics (one batch per call: a sqlite log call costs tens of milliseconds), the
policy versions it read and wrote, the step's Zarr group as an input dataset with the schema of
its arrays, and a table of decoded samples.
A resumed run continues its parent run (``run_id``).
"""

from __future__ import annotations

import json
import logging
import posixpath
import sqlite3
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import mlflow
import numpy as np
from mlflow.data.dataset_source import DatasetSource
from mlflow.data.dataset_source_registry import register_dataset_source
from mlflow.data.meta_dataset import MetaDataset
from mlflow.entities import DatasetInput, InputTag, Metric, Param, RunTag
from mlflow.tracking import MlflowClient
from mlflow.utils.mlflow_tags import MLFLOW_DATASET_CONTEXT, MLFLOW_LOGGED_ARTIFACTS
from mlflow.types import Schema, TensorSpec

__all__ = [
    "EXPERIMENT_KIND_TAG", "TRAINING_EXPERIMENT_KIND", "ZarrDatasetSource", "Lineage", "StepRun",
    "MAIN_METRICS", "experiment_page", "flatten", "git_commit", "iteration_runs", "parent_metric_names",
    "relocate_artifacts", "rollout_schema",
    "ui_command", "ui_environment",
]


class _ReraisedDatabaseError(logging.Filter):
    """Drops MLflow's own record of a SQLAlchemy OperationalError that it then re-raises
    (mlflow.store.db.utils logs "SQLAlchemy database error" with the whole traceback, then raises an
    MlflowException with the same message). The raised error is what the caller reports: for a full
    disk, the CLI's one line (flows/cli.py). Any other record passes."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith("SQLAlchemy database error")


def _quiet_reraised_database_errors() -> None:
    logger = logging.getLogger("mlflow.store.db.utils")
    if not any(isinstance(f, _ReraisedDatabaseError) for f in logger.filters):
        logger.addFilter(_ReraisedDatabaseError())


_quiet_reraised_database_errors()

_MAX_PARAM_LEN = 500  # MLflow's limit on a param value's length
# MLflow 3.x picks an experiment's page (GenAI traces or training runs) from this tag; the values
# are the UI's ExperimentKind enum ("genai_development", "custom_model_development", ...).
EXPERIMENT_KIND_TAG = "mlflow.experimentKind"
TRAINING_EXPERIMENT_KIND = "custom_model_development"
_GIT_COMMIT_TAG = "mlflow.source.git.commit"  # MLflow's own key: the run page shows it
PARENT_SECTION = "grpo"
MAIN_METRICS = ("reward_mean", "reward_std", "loss", "kl", "clip_fraction", "grad_norm", "completion_length_mean",
                "truncated_fraction", "iteration_seconds", "mfu", "eval_greedy_accuracy", "eval_accuracy",
                "eval_greedy_format_rate")
"""The curves a reader of a run looks at first. On the parent run they are logged as
``grpo/<name>``: MLflow's run page draws a section per name prefix, alphabetically, before the
unprefixed "Model metrics" (the diagnostics), so they come first, above ``reward/<function>``.
Child runs keep the plain names (the runs table's columns)."""


def parent_metric_names(metrics: dict[str, float]) -> dict[str, float]:
    """``metrics`` under the names the parent run logs them with (:data:`MAIN_METRICS`)."""
    return {(f"{PARENT_SECTION}/{k}" if k in MAIN_METRICS else k): v for k, v in metrics.items()}


class ZarrDatasetSource(DatasetSource):
    """A Zarr group (a step of the rollout store) as an MLflow dataset source."""

    def __init__(self, url: str):
        self.url = url

    @staticmethod
    def _get_source_type() -> str:
        return "zarr"

    def load(self, **kwargs) -> str:
        return self.url

    @staticmethod
    def _can_resolve(raw_source: Any) -> bool:
        return isinstance(raw_source, str) and ".zarr" in raw_source

    @classmethod
    def _resolve(cls, raw_source: Any) -> "ZarrDatasetSource":
        return cls(str(raw_source))

    def to_dict(self) -> dict[str, Any]:
        return {"url": self.url}

    @classmethod
    def from_dict(cls, source_dict: dict[Any, Any]) -> "ZarrDatasetSource":
        return cls(source_dict["url"])


register_dataset_source(ZarrDatasetSource)


def flatten(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(flatten(v, key + "."))
        else:
            out[key] = v
    return out


def git_commit(cwd: str | Path | None = None) -> str:
    """``git rev-parse HEAD`` of the checkout holding ``cwd`` (default: this package), else "unknown"."""
    where = Path(cwd) if cwd is not None else Path(__file__).resolve().parent
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=where, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return out.stdout.strip() if out.returncode == 0 and out.stdout.strip() else "unknown"


def rollout_schema(arrays: dict[str, tuple[str, tuple[int, ...]]]) -> Schema:
    """An MLflow schema of a step's Zarr arrays: ``{name: (dtype, shape)}``, the sample axis first
    (shown as -1: the number of samples varies with the config)."""
    return Schema([TensorSpec(np.dtype(dtype), (-1, *shape[1:]), name) for name, (dtype, shape) in arrays.items()])


def _now_ms() -> int:
    return int(time.time() * 1000)


class StepRun:
    """The child run of one step, open from :meth:`Lineage.start_step` until :meth:`end`.

    Used as a context manager it ends FAILED when the block raises, FINISHED otherwise.
    """

    def __init__(self, lineage: "Lineage", step: int, run_id: str):
        self.lineage, self.step, self.run_id = lineage, step, run_id
        self.ended = False
        self.end_time_ms: int | None = None
        """When the step's work ended (epoch ms); unset: the run ends when :meth:`end` is called."""

    def log_metrics(self, metrics: dict[str, float], on_parent: bool = True, tags: dict[str, str] | None = None
                    ) -> None:
        """The step's metrics (and ``tags``, in the same call); the parent gets the metrics too, so
        the UI plots the curve on one page, the main ones first (:data:`MAIN_METRICS`)."""
        self.lineage._log(self.run_id, metrics=metrics, tags=tags, step=self.step)
        if on_parent:
            self.lineage._log(self.lineage.run_id, metrics=parent_metric_names(metrics), step=self.step)

    @staticmethod
    def policy_tags(version_out: int, path: str, sha256: str) -> dict[str, str]:
        """The tags that name the policy version a step published (:meth:`log_policy`)."""
        return {"policy.version_out": str(version_out), "policy.version": str(version_out), "policy.path": path,
                "policy.sha256": sha256}

    def log_policy(self, version_out: int, path: str, sha256: str) -> None:
        """The policy version this step published."""
        self.lineage._log(self.run_id, tags=self.policy_tags(version_out, path, sha256))

    def log_rollouts(self, url: str, digest: str, arrays: dict[str, tuple[str, tuple[int, ...]]] | None = None
                     ) -> None:
        """The step's Zarr group as the run's training input; ``arrays`` ({name: (dtype, shape)})
        become the dataset's schema."""
        schema = rollout_schema(arrays) if arrays else None
        dataset = MetaDataset(ZarrDatasetSource(url), name=f"rollouts/step_{self.step}", digest=digest,
                              schema=schema)
        # The client call, not mlflow.start_run: resuming the run there would end it on exit.
        context = InputTag(key=MLFLOW_DATASET_CONTEXT, value="training")
        self.lineage.client.log_inputs(self.run_id, [DatasetInput(dataset._to_mlflow_entity(), [context])])

    def log_samples(self, table: dict[str, list], artifact_file: str | None = None, set_tag: bool = True
                    ) -> dict[str, str]:
        """A table of decoded samples (equal-length columns), shown by the run's artifact view.
        Returns the tag that marks the file as a table; ``set_tag=False`` leaves setting it to the
        caller (with :meth:`log_metrics`, one call fewer)."""
        if not any(table.values()):  # zero groups asked for: no empty table in the UI
            return {}
        name = artifact_file or f"samples/step_{self.step}.json"
        # What MlflowClient.log_table writes (a JSON table in pandas' "split" layout and the tag that
        # makes the UI show it as a table) without its reads: it lists the run's artifacts and
        # fetches the run to append to an earlier table of that name. A step's table is written
        # once, and a resumed step's replaces the earlier one instead of repeating its rows.
        rows = [[None if isinstance(v, float) and v != v else v for v in row] for row in zip(*table.values())]
        with tempfile.TemporaryDirectory() as tmp:
            path = Path(tmp) / Path(name).name
            path.write_text(json.dumps({"columns": list(table), "data": rows}))
            self.lineage.client.log_artifact(self.run_id, str(path), posixpath.dirname(name) or None)
        tags = {MLFLOW_LOGGED_ARTIFACTS: json.dumps([{"path": name, "type": "table"}])}
        if set_tag:
            self.lineage._log(self.run_id, tags=tags)
        return tags

    def log_artifact(self, path: str, artifact_path: str | None = None) -> None:
        self.lineage.client.log_artifact(self.run_id, path, artifact_path)

    def end(self, status: str = "FINISHED") -> None:
        if not self.ended:
            self.lineage.client.set_terminated(self.run_id, status=status, end_time=self.end_time_ms or _now_ms())
            self.ended = True

    def __enter__(self) -> "StepRun":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self.end("FAILED" if exc_type is not None else "FINISHED")


class Lineage:
    """A parent MLflow run for one ``grpoflow run``, and a child run per iteration."""

    def __init__(self, tracking_uri: str, experiment: str, run_name: str, params: dict[str, Any],
                 tags: dict[str, str] | None = None, artifact_location: str | None = None,
                 commit: str | None = None, run_id: str | None = None):
        self.tracking_uri = tracking_uri
        mlflow.set_tracking_uri(tracking_uri)
        self.client = MlflowClient(tracking_uri)
        exp = self.client.get_experiment_by_name(experiment)
        self.experiment_id = exp.experiment_id if exp else self.client.create_experiment(
            experiment, artifact_location=artifact_location)
        self.client.set_experiment_tag(self.experiment_id, EXPERIMENT_KIND_TAG, TRAINING_EXPERIMENT_KIND)
        self.params = {k: str(v)[:_MAX_PARAM_LEN] for k, v in flatten(params).items()}
        if run_id is not None:
            # A resumed run continues its parent run: params and config.yaml are logged already.
            self.run_id = run_id
            self.client.update_run(run_id, status="RUNNING", name=run_name)  # a copied folder's new name
            self._log(run_id, tags=tags)
            return
        all_tags = {_GIT_COMMIT_TAG: commit or git_commit(), **(tags or {})}
        parent = self.client.create_run(self.experiment_id, run_name=run_name, tags=all_tags)
        self.run_id = parent.info.run_id
        self._log(self.run_id, params=self.params)
        # Through JSON first: tuples become lists, which yaml.dump writes as plain YAML.
        self.client.log_dict(self.run_id, json.loads(json.dumps(params, default=str)), "config.yaml")

    def _log(self, run_id: str, metrics: dict[str, float] | None = None, params: dict[str, Any] | None = None,
             tags: dict[str, str] | None = None, step: int = 0) -> None:
        ts = _now_ms()
        self.client.log_batch(
            run_id,
            metrics=[Metric(k, float(v), ts, step) for k, v in (metrics or {}).items()],
            params=[Param(k, str(v)) for k, v in (params or {}).items()],
            tags=[RunTag(k, str(v)) for k, v in (tags or {}).items()],
        )

    def set_tags(self, tags: dict[str, str]) -> None:
        """Tags on the parent run (e.g. the Dask dashboard link once the cluster is up)."""
        self._log(self.run_id, tags=tags)

    def start_step(self, step: int, policy_version_in: int, start_time_ms: int | None = None,
                   reopen: bool = True) -> StepRun:
        """Open the child run of ``step``, started at ``start_time_ms`` (default now: the step's
        start); end it with :meth:`StepRun.end` or use it as a context manager. With ``reopen`` a
        child run of the step left by an interrupted process is reopened, so a resumed run keeps one
        child run per step; ``reopen=False`` skips that search (a step no earlier process started)."""
        earlier = reopen and self.client.search_runs(
            [self.experiment_id], max_results=1,
            filter_string=f"tags.mlflow.parentRunId = '{self.run_id}' and tags.`grpoflow.step` = '{step}'")
        if earlier:
            self.client.update_run(earlier[0].info.run_id, status="RUNNING")
            return StepRun(self, step, earlier[0].info.run_id)
        child = self.client.create_run(
            self.experiment_id, run_name=f"step={step}", start_time=start_time_ms or _now_ms(),
            tags={"mlflow.parentRunId": self.run_id, "grpoflow.step": str(step),
                  "policy.version_in": str(policy_version_in)})
        handle = StepRun(self, step, child.info.run_id)
        self._log(handle.run_id, params=self.params)
        return handle

    def log_artifact(self, run_id: str, path: str, artifact_path: str | None = None) -> None:
        self.client.log_artifact(run_id, path, artifact_path)

    def log_plots(self, paths: list[str | Path]) -> None:
        """PNG plots on the parent under ``plots/``; a later call with the same names replaces them."""
        for path in paths:
            self.client.log_artifact(self.run_id, str(path), "plots")

    def log_evals(self, results: dict[int, dict[str, float]]) -> None:
        """Held-out metrics by policy version on the parent, the version as their step; a version
        the parent already has (logged by an earlier process of a resumed run) is not logged again."""
        # Every evaluation stores eval_seconds, and a version's metrics are logged together.
        logged = {h.step for h in self.client.get_metric_history(self.run_id, "eval_seconds")} if results else set()
        for version, metrics in sorted(results.items()):
            if version not in logged:
                self._log(self.run_id, metrics=parent_metric_names(metrics), step=version)

    def log_summary(self, metrics: dict[str, float], artifact_paths: list[str] = ()) -> None:
        self._log(self.run_id, metrics=metrics)
        for path in artifact_paths:
            if Path(path).exists():
                self.client.log_artifact(self.run_id, path)

    def finish(self, status: str = "FINISHED") -> None:
        self.client.set_terminated(self.run_id, status=status, end_time=_now_ms())


def relocate_artifacts(db_path: str | Path, artifacts: str) -> str | None:
    """Point the artifact locations in a run folder's own MLflow store (sqlite ``db_path``) at
    ``artifacts``, the folder's artifact root, when they name another one: the folder was copied or
    moved, and MLflow records absolute paths, so the copy would otherwise log into, and show, the
    original's artifacts. Returns the old root (None when nothing pointed elsewhere). MLflow has no
    call for this; its ``experiments.artifact_location`` and ``runs.artifact_uri`` columns are
    rewritten in one transaction."""
    if not Path(db_path).is_file():
        return None
    with sqlite3.connect(db_path) as db:
        old = {row[0] for row in db.execute("SELECT artifact_location FROM experiments") if row[0]}
        moved = sorted(o for o in old if o != artifacts and o.endswith("/mlartifacts"))
        for root in moved:
            db.execute("UPDATE runs SET artifact_uri = ? || substr(artifact_uri, ?) "
                       "WHERE substr(artifact_uri, 1, ?) = ?", (artifacts, len(root) + 1, len(root) + 1, root + "/"))
            db.execute("UPDATE experiments SET artifact_location = ? WHERE artifact_location = ?", (artifacts, root))
    return moved[0] if moved else None


def iteration_runs(tracking_uri: str, parent_run_id: str):
    """The child runs of one ``grpoflow run`` as a pandas DataFrame, oldest step first."""
    mlflow.set_tracking_uri(tracking_uri)
    runs = mlflow.search_runs(search_all_experiments=True,
                              filter_string=f"tags.mlflow.parentRunId = '{parent_run_id}'")
    if "tags.grpoflow.step" not in runs.columns:  # no child run yet: an empty frame, not a KeyError
        runs["tags.grpoflow.step"] = []
    return runs.sort_values("tags.grpoflow.step", key=lambda s: s.astype(int)).reset_index(drop=True)


def ui_command(tracking_uri: str, port: int, host: str = "127.0.0.1") -> list[str]:
    """The ``mlflow ui`` command serving ``tracking_uri``: one worker process (a local store has
    one reader; the default of 4 only costs memory and start-up time)."""
    return [sys.executable, "-m", "mlflow", "ui", "--backend-store-uri", tracking_uri, "--host", host,
            "--port", str(port), "--workers", "1"]


def ui_environment(base: dict[str, str]) -> dict[str, str]:
    """``base`` with MLflow's server-side job runner off: it serves GenAI jobs (scorers, trace
    archival) through a pool of worker processes that a training store never uses."""
    return {**base, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}


def experiment_page(tracking_uri: str, experiment: str | None = None) -> str | None:
    """The UI route of a store's experiment (by name, else the newest one holding grpoflow runs),
    opening its training-runs view; None when the store has no such experiment."""
    client = MlflowClient(tracking_uri)
    if experiment is not None:
        exp = client.get_experiment_by_name(experiment)
    else:
        tagged = client.search_experiments(filter_string=f"tags.`{EXPERIMENT_KIND_TAG}` = '{TRAINING_EXPERIMENT_KIND}'",
                                           order_by=["creation_time DESC"], max_results=1)
        exp = tagged[0] if tagged else None
    if exp is None:
        return None
    # The 3.x UI takes its view from the workflowType query parameter (else the browser's last
    # choice, GenAI by default); the experiment tag alone does not switch it.
    return f"#/experiments/{exp.experiment_id}/runs?workflowType=machine_learning"
