"""The Zarr eval store: one group per evaluated policy version, one row per completion.

``runs/<run>/eval.zarr/v<k>/`` holds, for the held-out prompts of eval.path, each completion's
``prompt_index``, ``sample`` (0 greedy when eval.greedy, then the sampled ones), ``greedy``,
``tokens`` (padded), ``length``, ``finish_reason``, ``reward``, ``reward_failed`` and ``correct``;
its attributes hold the policy version, the eval config's hash and the metrics. The metrics are
written last: a group without them is an evaluation that did not finish, and is written again.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

import numpy as np
import zarr

__all__ = ["EVAL_ARRAYS", "EvalStoreError", "EvalStore"]

EVAL_ARRAYS = ("prompt_index", "sample", "greedy", "tokens", "length", "finish_reason", "reward", "reward_failed",
               "correct")


class EvalStoreError(RuntimeError):
    """An eval-store read or write failed; the message names the version."""


class EvalStore:
    def __init__(self, root: str | Path):
        self.root = str(root)

    def _path(self, version: int) -> str:
        return f"{self.root}/v{version}"

    def metrics(self, version: int, config_hash: str) -> Optional[dict[str, float]]:
        """The stored metrics of ``version``'s evaluation under the eval config ``config_hash``;
        None when it has none (never evaluated, unfinished, or under another eval config)."""
        try:
            attrs = zarr.open_group(self._path(version), mode="r").attrs.asdict()
        except (FileNotFoundError, zarr.errors.GroupNotFoundError):
            return None
        if attrs.get("config_hash") != config_hash or "metrics" not in attrs:
            return None
        return dict(attrs["metrics"])

    def save(self, version: int, arrays: dict[str, np.ndarray], metrics: dict[str, float], config_hash: str,
             extra: dict[str, Any] | None = None) -> None:
        """Write ``version``'s rows, then its metrics (the completion mark), replacing any earlier group."""
        missing = set(EVAL_ARRAYS) - arrays.keys()
        if missing:
            raise EvalStoreError(f"eval of v{version}: arrays {sorted(missing)} missing")
        try:
            group = zarr.open_group(self._path(version), mode="w")
            group.attrs.update({"policy_version": version, "config_hash": config_hash, **(extra or {})})
            for name in EVAL_ARRAYS:
                values = np.asarray(arrays[name])
                group.create_array(name, data=values, chunks=values.shape or None)
            group.attrs["metrics"] = {k: float(v) for k, v in metrics.items()}
        except OSError as exc:
            raise EvalStoreError(f"cannot write the evaluation of v{version} under {self.root}: {exc}") from exc

    def read(self, version: int, *names: str) -> dict[str, np.ndarray]:
        try:
            group = zarr.open_group(self._path(version), mode="r")
            return {name: group[name][...] for name in (names or EVAL_ARRAYS)}
        except (FileNotFoundError, KeyError, zarr.errors.GroupNotFoundError) as exc:
            raise EvalStoreError(f"no evaluation of v{version} under {self.root}") from exc

    def all_metrics(self) -> dict[int, dict[str, float]]:
        """Version -> metrics of every finished evaluation, ascending, whatever its eval config."""
        root = Path(self.root)
        out: dict[int, dict[str, float]] = {}
        for child in sorted(root.iterdir() if root.is_dir() else (), key=lambda c: (len(c.name), c.name)):
            if not (child.name.startswith("v") and child.name[1:].isdigit()):
                continue
            try:
                attrs = zarr.open_group(str(child), mode="r").attrs.asdict()
            except (FileNotFoundError, zarr.errors.GroupNotFoundError):
                continue
            if "metrics" in attrs:
                out[int(child.name[1:])] = dict(attrs["metrics"])
        return out
