"""Group-relative advantages over Zarr-stored groups, with dask.array.

    GRPO:     A_i = (R_i - mean(R_group)) / (std(R_group) + eps)
    Dr. GRPO: A_i = R_i - mean(R_group)                        (Liu et al. 2025, no std scaling)

std is the population standard deviation (ddof=0). A group whose rewards are all equal has zero
deviation from its mean, so its advantages are exactly 0, never NaN.
"""

from __future__ import annotations

import dask.array as da
import numpy as np

from stages.config import AdvantageConfig

__all__ = ["normalize_advantages"]


def normalize_advantages(rewards: da.Array, group_size: int, cfg: AdvantageConfig) -> da.Array:
    """rewards: [num_samples] with chunks that are multiples of group_size -> advantages [num_samples]."""
    if rewards.shape[0] % group_size:
        raise ValueError(f"{rewards.shape[0]} rewards do not form whole groups of {group_size}")
    if any(c % group_size for c in rewards.chunks[0]):
        raise ValueError(f"reward chunks {rewards.chunks[0]} split a group of {group_size}")
    grouped = rewards.astype(np.float64).reshape(-1, group_size)  # (num_groups, G); chunks stay whole groups
    centred = grouped - grouped.mean(axis=1, keepdims=True)
    if cfg.estimator == "grpo":
        centred = centred / (grouped.std(axis=1, keepdims=True) + cfg.eps)
    return centred.reshape(-1).astype(np.float32)

