"""The Zarr eval store: one group per evaluated policy version, one row per completion.

``runs/<run>/eval.zarr/v<k>/`` holds, for the held-out prompts of eval.path, each completion's
``prompt_index``, ``sample`` (0 greedy when eval.greedy, then the sampled ones), ``greedy``,
``tokens`` (padded), ``length``, ``finish_reason``, ``reward``, ``reward_failed`` and ``correct``;
its attributes hold the policy version, the sha256 of its weights, the eval config's hash and the
metrics. A group is written beside its place and renamed into it, metrics last: a group without
them did not finish, and one of another eval config or other weights is evaluated again (a version
holds the evaluation of the config it was last evaluated under).
"""

from __future__ import annotations

import os
import shutil
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

    def _attrs(self, path: str) -> Optional[dict[str, Any]]:
        """A group's attributes; None when it is missing or unreadable (damaged, half-written)."""
        try:
            return zarr.open_group(path, mode="r").attrs.asdict()
        except (OSError, ValueError):  # zarr's own errors are ValueErrors (GroupNotFoundError, bad JSON)
            return None

    def metrics(self, version: int, config_hash: str, policy_sha256: str) -> Optional[dict[str, float]]:
        """The stored metrics of ``version``'s evaluation under the eval config ``config_hash``, of
        the weights ``policy_sha256``; None when there are none (never evaluated, unfinished, another
        eval config or other weights)."""
        attrs = self._attrs(self._path(version))
        if (attrs is None or attrs.get("config_hash") != config_hash or attrs.get("policy_sha256") != policy_sha256
                or "metrics" not in attrs):
            return None
        return dict(attrs["metrics"])

    def save(self, version: int, arrays: dict[str, np.ndarray], metrics: dict[str, float], config_hash: str,
             extra: dict[str, Any] | None = None) -> None:
        """Write ``version``'s rows, then its metrics (the completion mark), replacing any earlier group."""
        missing = set(EVAL_ARRAYS) - arrays.keys()
        if missing:
            raise EvalStoreError(f"eval of v{version}: arrays {sorted(missing)} missing")
        final = Path(self._path(version))
        tmp = final.with_name(f".{final.name}.tmp-{os.getpid()}")
        try:
            shutil.rmtree(tmp, ignore_errors=True)
            group = zarr.open_group(str(tmp), mode="w")
            group.attrs.update({"policy_version": version, "config_hash": config_hash, **(extra or {})})
            for name in EVAL_ARRAYS:
                values = np.asarray(arrays[name])
                group.create_array(name, data=values, chunks=values.shape or None)
            group.attrs["metrics"] = {k: float(v) for k, v in metrics.items()}
            # Whole into place: a reader sees the old group or the new one, never a mix of two writers'.
            old = final.with_name(f".{final.name}.old-{os.getpid()}")
            if final.exists():
                final.rename(old)
            tmp.rename(final)
            shutil.rmtree(old, ignore_errors=True)
        except OSError as exc:
            shutil.rmtree(tmp, ignore_errors=True)
            raise EvalStoreError(f"cannot write the evaluation of v{version} under {self.root}: {exc}") from exc

    def read(self, version: int, *names: str) -> dict[str, np.ndarray]:
        try:
            group = zarr.open_group(self._path(version), mode="r")
            return {name: group[name][...] for name in (names or EVAL_ARRAYS)}
        except (OSError, KeyError, ValueError) as exc:
            raise EvalStoreError(f"no evaluation of v{version} under {self.root}") from exc

    def all_metrics(self, config_hash: Optional[str] = None) -> dict[int, dict[str, float]]:
        """Version -> metrics of every finished evaluation (under the eval config ``config_hash``;
        None: any), ascending. An unreadable group is passed over."""
        root = Path(self.root)
        out: dict[int, dict[str, float]] = {}
        for child in sorted(root.iterdir() if root.is_dir() else (), key=lambda c: (len(c.name), c.name)):
            if not (child.name.startswith("v") and child.name[1:].isdigit()):
                continue
            attrs = self._attrs(str(child))
            if attrs and "metrics" in attrs and config_hash in (None, attrs.get("config_hash")):
                out[int(child.name[1:])] = dict(attrs["metrics"])
        return out
