"""Group advantages with dask.array equal a plain numpy implementation."""

from __future__ import annotations

import dask.array as da
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from stages.advantage import normalize_advantages
from stages.config import AdvantageConfig


def numpy_advantages(rewards: np.ndarray, group_size: int, estimator: str, eps: float) -> np.ndarray:
    """Independent reference: loop over groups with numpy's mean and population std."""
    out = np.empty(len(rewards), dtype=np.float64)
    for g in range(0, len(rewards), group_size):
        r = rewards[g:g + group_size].astype(np.float64)
        out[g:g + group_size] = r - r.mean()
        if estimator == "grpo":
            out[g:g + group_size] /= r.std() + eps
    return out


@settings(max_examples=40, deadline=None)
@given(num_groups=st.integers(1, 12), group_size=st.integers(2, 9), groups_per_chunk=st.integers(1, 4),
       estimator=st.sampled_from(["grpo", "dr_grpo"]), seed=st.integers(0, 10_000))
def test_dask_matches_numpy(num_groups, group_size, groups_per_chunk, estimator, seed):
    rng = np.random.default_rng(seed)
    rewards = rng.choice([0.0, 0.5, 1.0], size=num_groups * group_size).astype(np.float32)
    cfg = AdvantageConfig(estimator=estimator)
    got = normalize_advantages(da.from_array(rewards, chunks=groups_per_chunk * group_size), group_size, cfg)
    np.testing.assert_allclose(got.compute(scheduler="synchronous"),
                               numpy_advantages(rewards, group_size, estimator, cfg.eps), rtol=1e-5, atol=1e-6)


def test_zero_variance_group_gets_zero_never_nan():
    rewards = np.array([1, 1, 1, 1, 0, 1, 0, 1], dtype=np.float32)
    adv = normalize_advantages(da.from_array(rewards, chunks=4), 4, AdvantageConfig()).compute()
    assert np.all(adv[:4] == 0.0)
    np.testing.assert_allclose(adv[4:], [-1, 1, -1, 1], atol=1e-5)


def test_chunks_that_split_a_group_are_refused():
    with pytest.raises(ValueError, match="split a group"):
        normalize_advantages(da.from_array(np.zeros(8, np.float32), chunks=3), 4, AdvantageConfig())
