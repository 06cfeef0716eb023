"""Reward scoring: the registry, and faults that must not stop the iteration."""

from __future__ import annotations

import math
import time

import numpy as np
import pytest

from stages.reward import REWARDS, get_reward, register_reward, score_samples


@pytest.fixture
def temporary_rewards():
    added = []

    def add(name, fn):
        register_reward(name)(fn)
        added.append(name)

    yield add
    for name in added:
        REWARDS.pop(name)


def test_exact_match_checks_the_sum():
    fn = get_reward("exact_match")
    assert fn("12+34=", "46") == 1.0
    assert fn("12+34=", "45") == 0.0
    assert fn("99+1=", "100") == 1.0


def test_digit_match_gives_partial_credit():
    fn = get_reward("digit_match")
    assert fn("12+34=", "46") == 1.0
    assert fn("12+34=", "41") == pytest.approx(0.5)


def test_raising_nan_and_slow_rewards_score_zero_and_are_flagged(temporary_rewards):
    temporary_rewards("t_raises", lambda p, c: 1 / 0 if c == "boom" else 1.0)
    temporary_rewards("t_nan", lambda p, c: math.nan if c == "nan" else 0.0)
    temporary_rewards("t_slow", lambda p, c: time.sleep(2.0) or 0.0 if c == "slow" else 0.0)
    scored = score_samples(["1+1="] * 5, ["ok", "boom", "nan", "slow", "ok"], ["t_raises", "t_nan", "t_slow"],
                           timeout_s=0.2)
    np.testing.assert_array_equal(scored.failed, [False, True, True, True, False])
    np.testing.assert_array_equal(scored.reward, [1.0, 0.0, 0.0, 0.0, 1.0])


def test_unknown_reward_names_the_known_ones():
    with pytest.raises(KeyError, match="exact_match"):
        get_reward("no_such_reward")
