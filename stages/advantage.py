"""Group-relative advantages over Zarr-stored groups, with dask.array.

    GRPO:     A_i = (R_i - mean(R_group)) / (std(R_group) + eps)
    Dr. GRPO: A_i = R_i - mean(R_group)                        (Liu et al. 2025, no std scaling)

std is the population standard deviation (ddof=0). A group whose rewards are all equal has zero
deviation from its mean, so its advantages are exactly 0, never NaN.

A sample whose reward failed (timeout, exception: stages/reward) carries no learning signal: mean
and std run over the group's valid samples only, and the failed sample gets A = 0. A group left
with fewer than MIN_VALID_PER_GROUP valid samples has nothing to be relative to: every sample of
it gets A = 0 and is left out of the loss (:func:`trained_samples`, used by stages/train/batch.py).
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, Optional, TypeVar

import numpy as np

from stages.config import AdvantageConfig

if TYPE_CHECKING:
    import dask.array as da

__all__ = ["normalize_advantages", "trained_samples", "informative_groups", "MIN_VALID_PER_GROUP"]

MIN_VALID_PER_GROUP = 2  # one valid sample alone has no group to be relative to

_Array = TypeVar("_Array", np.ndarray, "da.Array")


def _is_dask(x) -> bool:
    """``x`` is a dask array. dask is imported by whoever made one, so the stages (the training
    batch imports this module) need only numpy where no dask array is used."""
    dask_array = sys.modules.get("dask.array")
    return dask_array is not None and isinstance(x, dask_array.Array)


def trained_samples(valid: _Array, group_size: int) -> _Array:
    """valid: [num_samples] bool (the reward was scored) -> [num_samples] bool: valid and in a group
    with >= MIN_VALID_PER_GROUP valid samples. numpy in, numpy out; dask in, dask out."""
    grouped = valid.astype(bool).reshape(-1, group_size)  # (num_groups, G)
    enough = grouped.sum(axis=1, keepdims=True) >= MIN_VALID_PER_GROUP
    return (grouped & enough).reshape(-1)


def informative_groups(rewards: np.ndarray, failed: np.ndarray, group_size: int) -> np.ndarray:
    """[num_groups] bool: groups whose advantages are not all 0, i.e. with >= MIN_VALID_PER_GROUP
    valid samples whose rewards are not all equal (what rollout.dynamic_sampling keeps)."""
    valid = trained_samples(~np.asarray(failed, bool), group_size).reshape(-1, group_size)
    grouped = np.asarray(rewards, np.float64).reshape(-1, group_size)
    spread = np.where(valid, grouped, -np.inf).max(axis=1) - np.where(valid, grouped, np.inf).min(axis=1)
    return valid.any(axis=1) & (spread > 0)


def normalize_advantages(rewards: _Array, group_size: int, cfg: AdvantageConfig,
                         valid: Optional[_Array] = None) -> _Array:
    """rewards: [num_samples] with chunks that are multiples of group_size -> advantages [num_samples].

    valid: [num_samples] bool, chunked like rewards (``~reward_failed``); None: every sample is valid.
    Samples outside :func:`trained_samples` get 0, whatever their stored reward (NaN included).
    numpy in, numpy out (a step's rewards fit in memory: no task graph to build); dask in, dask out.
    """
    if rewards.shape[0] % group_size:
        raise ValueError(f"{rewards.shape[0]} rewards do not form whole groups of {group_size}")
    lazy = _is_dask(rewards)
    if lazy:
        import dask.array as da

        if any(c % group_size for c in rewards.chunks[0]):
            raise ValueError(f"reward chunks {rewards.chunks[0]} split a group of {group_size}")
    if valid is None:
        valid = (da.ones(rewards.shape, dtype=bool, chunks=rewards.chunks) if lazy
                 else np.ones(rewards.shape, dtype=bool))
    elif valid.shape != rewards.shape or getattr(valid, "chunks", None) != getattr(rewards, "chunks", None):
        raise ValueError(f"validity {valid.shape} in chunks {getattr(valid, 'chunks', None)} must match the "
                         f"rewards {rewards.shape} in chunks {getattr(rewards, 'chunks', None)}")
    if lazy:  # a chunk holds whole groups, so each is normalised on its own: one task per chunk
        return da.map_blocks(_normalize_groups, rewards, valid, group_size, cfg, dtype=np.float32)
    return _normalize_groups(rewards, valid, group_size, cfg)


def _normalize_groups(rewards: np.ndarray, valid: np.ndarray, group_size: int, cfg: AdvantageConfig) -> np.ndarray:
    """:func:`normalize_advantages` of whole groups in memory."""
    keep = trained_samples(valid, group_size).reshape(-1, group_size)  # (num_groups, G)
    count = np.maximum(keep.sum(axis=1, keepdims=True), 1)  # (num_groups, 1); >= 2 where any is kept
    # Selected, never multiplied: a failed sample's reward may be NaN.
    grouped = np.where(keep, rewards.astype(np.float64).reshape(-1, group_size), 0.0)
    centred = np.where(keep, grouped - grouped.sum(axis=1, keepdims=True) / count, 0.0)
    if cfg.estimator == "grpo":
        std = np.sqrt((centred ** 2).sum(axis=1, keepdims=True) / count)
        centred = centred / (std + cfg.eps)
    return centred.reshape(-1).astype(np.float32)
