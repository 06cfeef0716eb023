"""MLflow lineage: the only module that calls MLflow.

One parent run per run folder (a resumed run continues it: ``run_id``); one child run per iteration with the config as params, the
step's metrics (logged in one batch per step: a sqlite log call costs tens of milliseconds), the
step's Zarr group as an input dataset (source type ``zarr``, with a content digest) and the
policy version's path and hash as tags.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import mlflow
from mlflow.data.dataset_source import DatasetSource
from mlflow.data.dataset_source_registry import register_dataset_source
from mlflow.data.meta_dataset import MetaDataset
from mlflow.entities import Metric, Param, RunTag
from mlflow.tracking import MlflowClient

__all__ = ["ZarrDatasetSource", "Lineage", "flatten", "iteration_runs"]

_MAX_PARAM_LEN = 500  # MLflow's limit on a param value's length


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


class Lineage:
    """A parent MLflow run for one ``grpoflow run``, and a child run per iteration."""

    def __init__(self, tracking_uri: str, experiment: str, run_name: str, params: dict[str, Any],
                 tags: dict[str, str] | None = None, artifact_location: str | None = None,
                 run_id: str | None = None):
        self.tracking_uri = tracking_uri
        mlflow.set_tracking_uri(tracking_uri)
        self.client = MlflowClient(tracking_uri)
        exp = self.client.get_experiment_by_name(experiment)
        self.experiment_id = exp.experiment_id if exp else self.client.create_experiment(
            experiment, artifact_location=artifact_location)
        self.params = {k: str(v)[:_MAX_PARAM_LEN] for k, v in flatten(params).items()}
        if run_id is not None:
            # A resumed run continues its parent run: params are logged already, the status runs again.
            self.run_id = run_id
            self.client.update_run(run_id, status="RUNNING")
            self._log(run_id, tags=tags)
            return
        parent = self.client.create_run(self.experiment_id, run_name=run_name, tags=tags or {})
        self.run_id = parent.info.run_id
        self._log(self.run_id, params=self.params)

    def _log(self, run_id: str, metrics: dict[str, float] | None = None, params: dict[str, Any] | None = None,
             tags: dict[str, str] | None = None, step: int = 0) -> None:
        ts = int(time.time() * 1000)
        self.client.log_batch(
            run_id,
            metrics=[Metric(k, float(v), ts, step) for k, v in (metrics or {}).items()],
            params=[Param(k, str(v)) for k, v in (params or {}).items()],
            tags=[RunTag(k, str(v)) for k, v in (tags or {}).items()],
        )

    def log_iteration(self, step: int, metrics: dict[str, float], rollout_url: str, rollout_digest: str,
                      policy_path: str, policy_sha256: str, policy_version: int) -> str:
        """A finished child run for one iteration; returns its run id."""
        child = self.client.create_run(
            self.experiment_id, run_name=f"step={step}",
            tags={"mlflow.parentRunId": self.run_id, "grpoflow.step": str(step)})
        cid = child.info.run_id
        self._log(cid, metrics=metrics, params=self.params, step=step, tags={
            "policy.path": policy_path, "policy.sha256": policy_sha256, "policy.version": str(policy_version)})
        dataset = MetaDataset(ZarrDatasetSource(rollout_url), name=f"rollouts/step_{step}", digest=rollout_digest)
        with mlflow.start_run(run_id=cid):
            mlflow.log_input(dataset, context="training")
        self.client.set_terminated(cid)
        # The parent carries the per-iteration curve too, so the UI plots it on one page.
        self._log(self.run_id, metrics=metrics, step=step)
        return cid

    def log_artifact(self, run_id: str, path: str, artifact_path: str | None = None) -> None:
        self.client.log_artifact(run_id, path, artifact_path)

    def log_summary(self, metrics: dict[str, float], artifact_paths: list[str] = ()) -> None:
        self._log(self.run_id, metrics=metrics)
        for path in artifact_paths:
            if Path(path).exists():
                self.client.log_artifact(self.run_id, path)

    def finish(self, status: str = "FINISHED") -> None:
        self.client.set_terminated(self.run_id, status=status)


def iteration_runs(tracking_uri: str, parent_run_id: str):
    """The child runs of one ``grpoflow run`` as a pandas DataFrame, oldest step first."""
    mlflow.set_tracking_uri(tracking_uri)
    runs = mlflow.search_runs(search_all_experiments=True,
                              filter_string=f"tags.mlflow.parentRunId = '{parent_run_id}'")
    return runs.sort_values("tags.grpoflow.step", key=lambda s: s.astype(int)).reset_index(drop=True)
