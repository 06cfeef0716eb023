"""The run folder: the one owner of every path of a run, and the run-level files written there.

    <runs_dir>/<run_name>/
        rollouts.zarr/        step groups (storage/rollouts.py)
        .rollouts.zarr.locks/ their attribute locks (storage/rollouts.py), outside the Zarr hierarchy
        eval.zarr/v<k>/       held-out evaluation of policy version k (storage/evals.py)
        policy/v<k>/          policy versions as HF folders (storage/policies.py)
        timelines/step_<k>.json  Chrome traces of the training ranks
        mlflow.db             MLflow tracking store (when mlflow.tracking_uri is unset)
        mlartifacts/          MLflow artifacts
        summary.json          the run's summary
        run.json              the config the run was started with, its hash and MLflow parent run id
        error.txt             the traceback of the failed step that last ended the run
    <runs_dir>/.<run_name>.lock  held by the one driver of the run (:meth:`RunFolder.lock`)
    <runs_dir>/_cache/        base policies shared by runs (or $GRPOFLOW_CACHE)

Nothing else in the code base spells these names; flows, the CLI, tests and the notebook ask a
:class:`RunFolder`.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

from storage.evals import EvalStore
from storage.policies import PolicyStore
from storage.rollouts import RolloutStore
from storage.summary import to_strict_json

__all__ = ["CACHE_ENV", "RunFolderError", "RunFolder"]

CACHE_ENV = "GRPOFLOW_CACHE"
"""Environment variable naming a base-policy cache shared by every runs_dir (tests, CI)."""


class RunFolderError(RuntimeError):
    """A run-level file could not be written or read; the message names the file."""


@dataclass(frozen=True)
class RunFolder:
    """Absolute paths of one run; small and picklable, so Dask tasks carry it."""

    root: str
    """<runs_dir>/<run_name>, absolute."""
    cache_root: str
    """Where base policies made by the warm-up are cached across runs, absolute."""

    @classmethod
    def at(cls, runs_dir: str | Path, run_name: str, cache_dir: str | None = None) -> "RunFolder":
        """The folder of run ``run_name`` under ``runs_dir``; the cache is ``cache_dir``, else
        $GRPOFLOW_CACHE, else ``<runs_dir>/_cache``."""
        runs = Path(runs_dir).resolve()
        cache = cache_dir or os.environ.get(CACHE_ENV, "") or str(runs / "_cache")
        return cls(str(runs / run_name), str(Path(cache).resolve()))

    # -- paths ----------------------------------------------------------------------------------
    @property
    def rollouts(self) -> str:
        return f"{self.root}/rollouts.zarr"

    @property
    def evals(self) -> str:
        return f"{self.root}/eval.zarr"

    @property
    def policies(self) -> str:
        return f"{self.root}/policy"

    @property
    def timelines(self) -> str:
        return f"{self.root}/timelines"

    @property
    def mlflow_db(self) -> str:
        return f"{self.root}/mlflow.db"

    @property
    def tracking_uri(self) -> str:
        """The default MLflow tracking URI: sqlite in the run folder."""
        return f"sqlite:///{self.mlflow_db}"

    @property
    def artifacts(self) -> str:
        return f"{self.root}/mlartifacts"

    @property
    def plots(self) -> str:
        """Reward, stage-seconds and bubble plots (storage/plots.py), logged to the parent run."""
        return f"{self.root}/plots"

    @property
    def summary(self) -> str:
        return f"{self.root}/summary.json"

    @property
    def run_state(self) -> str:
        return f"{self.root}/run.json"

    @property
    def error_file(self) -> str:
        return f"{self.root}/error.txt"

    def trace(self, step: int) -> str:
        return f"{self.timelines}/step_{step}.json"

    def base_policy_cache(self, key: str) -> str:
        """The cached base policy made from everything hashed into ``key``."""
        return f"{self.cache_root}/base-{key}"

    # -- stores ---------------------------------------------------------------------------------
    def rollout_store(self) -> RolloutStore:
        return RolloutStore(self.rollouts)

    def eval_store(self) -> EvalStore:
        return EvalStore(self.evals)

    def policy_store(self) -> PolicyStore:
        return PolicyStore(self.policies)

    # -- run-level files ------------------------------------------------------------------------
    @property
    def lock_file(self) -> str:
        """Beside the folder, not in it: taken before anything of the run is read or written."""
        root = Path(self.root)
        return str(root.parent / f".{root.name}.lock")

    @contextlib.contextmanager
    def lock(self) -> Iterator[None]:
        """Hold the run's lock for the ``with`` block: a second driver of the same run folder is
        refused in one line naming the holder's pid. The kernel drops an flock with its process,
        so the lock of a driver that died is free again; the file stays (removing it would let a
        late opener lock a file no longer at the path)."""
        path = Path(self.lock_file)
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as exc:
            raise RunFolderError(f"cannot create the run's lock file {path}: {exc}") from exc
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = os.pread(fd, 64, 0).decode(errors="replace").strip() or "unknown"
                raise RunFolderError(f"run folder {self.root} is in use by another grpoflow process (pid {holder}); "
                                     "wait for it to finish or stop it, or give this run another run_name") from None
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
            yield
        finally:
            os.close(fd)  # releases the flock

    def create(self) -> "RunFolder":
        """Make the folder and its timelines/ (idempotent)."""
        try:
            Path(self.timelines).mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise RunFolderError(f"cannot create the run folder {self.root}: {exc}") from exc
        return self

    def save_summary(self, summary: dict[str, Any]) -> str:
        """Write summary.json; returns its path."""
        return self._write_json(self.summary, summary, indent=1)

    def load_summary(self) -> dict[str, Any]:
        try:
            return json.loads(Path(self.summary).read_text())
        except Exception as exc:
            raise RunFolderError(f"cannot read {self.summary}: {exc}") from exc

    def save_run_state(self, state: dict[str, Any]) -> str:
        """Write run.json (config, config_hash, mlflow_run_id): what a resumed run compares and continues."""
        return self._write_json(self.run_state, state, indent=1)

    def load_run_state(self) -> dict[str, Any] | None:
        """run.json, or None for a folder that never started a run."""
        if not Path(self.run_state).exists():
            return None
        try:
            state = json.loads(Path(self.run_state).read_text())
        except Exception as exc:
            raise RunFolderError(f"cannot read {self.run_state}: {exc}; delete it or start with --new") from exc
        if not isinstance(state, dict):
            raise RunFolderError(f"{self.run_state} holds a JSON {type(state).__name__}, not the run's state object; "
                                 "delete it or start with --new")
        return state

    def save_error(self, text: str) -> str:
        """Write error.txt, the traceback of the failed step that ended the run; returns its path."""
        try:
            Path(self.error_file).write_text(text)
        except OSError as exc:
            raise RunFolderError(f"cannot write {self.error_file}: {exc}") from exc
        return self.error_file

    def exists(self) -> bool:
        """Whether a run has stored anything here."""
        return Path(self.run_state).exists() or Path(self.rollouts).exists() or Path(self.policies).exists()

    def save_trace(self, step: int, events: list[dict]) -> str:
        """Write step ``step``'s Chrome trace (chrome://tracing, Perfetto); returns its path."""
        return self._write_json(self.trace(step), {"traceEvents": events, "displayTimeUnit": "ms"})

    def _write_json(self, path: str, data: Any, indent: int | None = None) -> str:
        target = Path(path)
        tmp = target.with_suffix(target.suffix + ".tmp")
        try:
            target.parent.mkdir(parents=True, exist_ok=True)
            tmp.write_text(json.dumps(to_strict_json(data), indent=indent, allow_nan=False))  # no bare NaN
            os.replace(tmp, target)  # a reader never sees a half-written file
        except Exception as exc:
            raise RunFolderError(f"cannot write {path}: {exc}") from exc
        return str(target)
