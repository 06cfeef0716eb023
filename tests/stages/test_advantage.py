"""Group advantages with dask.array equal a plain numpy implementation."""

from __future__ import annotations

import dask.array as da
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from stages.advantage import normalize_advantages, trained_samples
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
    # Chunked or whole, the same numbers bit for bit (each group is normalised on its own).
    np.testing.assert_array_equal(got.compute(scheduler="synchronous"), normalize_advantages(rewards, group_size, cfg))


def test_zero_variance_group_gets_zero_never_nan():
    rewards = np.array([1, 1, 1, 1, 0, 1, 0, 1], dtype=np.float32)
    adv = normalize_advantages(da.from_array(rewards, chunks=4), 4, AdvantageConfig()).compute()
    assert np.all(adv[:4] == 0.0)
    np.testing.assert_allclose(adv[4:], [-1, 1, -1, 1], atol=1e-5)


def test_chunks_that_split_a_group_are_refused():
    with pytest.raises(ValueError, match="split a group"):
        normalize_advantages(da.from_array(np.zeros(8, np.float32), chunks=3), 4, AdvantageConfig())


# -- failed rewards -------------------------------------------------------------------------------
def numpy_advantages_valid(rewards, valid, group_size, estimator, eps):
    """Independent reference: per group, numpy over the valid samples only; < 2 valid: all 0."""
    out = np.zeros(len(rewards), dtype=np.float64)
    for g in range(0, len(rewards), group_size):
        ok = valid[g:g + group_size]
        if ok.sum() < 2:
            continue
        r = rewards[g:g + group_size][ok].astype(np.float64)
        a = r - r.mean()
        if estimator == "grpo":
            a /= r.std() + eps
        out[g:g + group_size][ok] = a
    return out


def test_failed_samples_by_hand():
    nan = np.nan  # a failed reward's stored value must not matter
    rewards = np.array([1, 0, nan, 1, 0.5, nan, 7, 3, 0, 0, 1, 1], dtype=np.float32)
    failed = np.array([0, 0, 1, 0, 0, 1, 1, 1, 0, 0, 0, 0], dtype=bool)
    # Group 1, valid rewards 1, 0, 1: mean 2/3, std sqrt(((1/3)^2 * 2 + (2/3)^2) / 3) = sqrt(2/9) = 0.471405
    #   A = (1/3) / 0.471405 = 0.707107, (-2/3) / 0.471405 = -1.414214, failed -> 0.
    # Group 2 has one valid sample: all 0. Group 3, all valid 0, 0, 1, 1: mean 1/2, std 1/2 -> -1, -1, 1, 1.
    want = [0.707107, -1.414214, 0, 0.707107, 0, 0, 0, 0, -1, -1, 1, 1]
    got = normalize_advantages(da.from_array(rewards, chunks=4), 4, AdvantageConfig(),
                               valid=da.from_array(~failed, chunks=4)).compute()
    np.testing.assert_allclose(got, want, atol=1e-5)
    dr = normalize_advantages(da.from_array(rewards, chunks=8), 4, AdvantageConfig(estimator="dr_grpo"),
                              valid=da.from_array(~failed, chunks=8)).compute()
    np.testing.assert_allclose(dr, [1 / 3, -2 / 3, 0, 1 / 3, 0, 0, 0, 0, -0.5, -0.5, 0.5, 0.5], atol=1e-6)
    np.testing.assert_array_equal(trained_samples(~failed, 4), [1, 1, 0, 1, 0, 0, 0, 0, 1, 1, 1, 1])


@settings(max_examples=30, deadline=None)
@given(num_groups=st.integers(1, 8), group_size=st.integers(2, 6), estimator=st.sampled_from(["grpo", "dr_grpo"]),
       seed=st.integers(0, 10_000))
def test_dask_matches_numpy_with_failures(num_groups, group_size, estimator, seed):
    rng = np.random.default_rng(seed)
    rewards = rng.choice([0.0, 0.5, 1.0], size=num_groups * group_size).astype(np.float32)
    valid = rng.random(len(rewards)) < 0.7
    cfg = AdvantageConfig(estimator=estimator)
    got = normalize_advantages(da.from_array(rewards, chunks=group_size), group_size, cfg,
                               valid=da.from_array(valid, chunks=group_size))
    np.testing.assert_allclose(got.compute(scheduler="synchronous"),
                               numpy_advantages_valid(rewards, valid, group_size, estimator, cfg.eps),
                               rtol=1e-5, atol=1e-6)


def test_validity_chunked_unlike_rewards_is_refused():
    with pytest.raises(ValueError, match="validity"):
        normalize_advantages(da.from_array(np.zeros(8, np.float32), chunks=4), 4, AdvantageConfig(),
                             valid=da.from_array(np.ones(8, bool), chunks=8))


# -- numpy in, numpy out (the flow's advantage task: no task graph for a step's few rewards) -----
@settings(max_examples=30, deadline=None)
@given(num_groups=st.integers(1, 12), group_size=st.integers(2, 9),
       estimator=st.sampled_from(["grpo", "dr_grpo"]), seed=st.integers(0, 10_000))
def test_numpy_input_matches_reference(num_groups, group_size, estimator, seed):
    rng = np.random.default_rng(seed)
    rewards = rng.choice([0.0, 0.5, 1.0], size=num_groups * group_size).astype(np.float32)
    cfg = AdvantageConfig(estimator=estimator)
    got = normalize_advantages(rewards, group_size, cfg)
    assert isinstance(got, np.ndarray) and got.dtype == np.float32
    np.testing.assert_allclose(got, numpy_advantages(rewards, group_size, estimator, cfg.eps), rtol=1e-5, atol=1e-6)


def test_numpy_input_failed_samples_by_hand():
    rewards = np.array([1, 0, np.nan, 1, 0.5, np.nan, 7, 3, 0, 0, 1, 1], dtype=np.float32)
    failed = np.array([0, 0, 1, 0, 0, 1, 1, 1, 0, 0, 0, 0], dtype=bool)
    got = normalize_advantages(rewards, 4, AdvantageConfig(), valid=~failed)  # the numbers worked out above
    np.testing.assert_allclose(got, [0.707107, -1.414214, 0, 0.707107, 0, 0, 0, 0, -1, -1, 1, 1], atol=1e-5)
