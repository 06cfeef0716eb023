"""math_answer (math-verify) on tricky completions, called directly and through the reward process."""

from __future__ import annotations

import numpy as np
import pytest

from stages.reward import get_reward, score_samples
from stages.reward.isolated import close_reward_processes

import math_verify  # noqa: F401  a dependency of math_answer: fail, never skip, without it

CASES = [
    # (gold, completion, expected reward)
    ("1234", "The total is 1,234.", 1.0),                      # thousands comma
    ("1234567", "So she saved $1,234,567 in all.", 1.0),
    ("1234", "The total is 1,243.", 0.0),
    ("0.5", "Each gets 1/2 of the pie.", 1.0),                 # fraction vs decimal
    ("1/2", "The answer is \\boxed{0.5}", 1.0),
    ("7", "\\frac{14}{2}", 1.0),
    ("3.5", "It costs $3.50.", 1.0),                           # trailing zero, dollar sign
    ("12", "He has 12 apples.", 1.0),                          # trailing unit
    ("120", "The train covers 120 km.", 1.0),
    ("12", "First 3 + 4 = 7, then 7 + 5 = 12.", 1.0),          # several numbers: the last counts
    ("12", "I get 12, then subtract 9 to get 3.", 0.0),
    ("42", "\\boxed{42}", 1.0),                                # boxed
    ("42", "\\boxed{41}", 0.0),
    ("42", "Work: 40 + 2, so \\boxed{42}, then 7 more steps", 1.0),  # boxed wins over later numbers
    ("-3", "The change is -3 degrees.", 1.0),
    ("5", "no number here", 0.0),
    ("5", "", 0.0),
]


@pytest.mark.parametrize("gold, completion, expected", CASES)
def test_math_answer_on_tricky_completions(gold, completion, expected):
    assert get_reward("math_answer")(prompt="q", completion=completion, answer=gold) == expected


def test_math_answer_needs_an_answer():
    with pytest.raises(ValueError, match="dataset.answer_field"):
        get_reward("math_answer")(prompt="q", completion="1")


def test_math_answer_through_the_reward_process():
    try:
        golds, completions, expected = zip(*CASES)
        scored = score_samples(["q"] * len(CASES), list(completions), ["stages.reward.math_answer:math_answer"],
                               timeout_s=20.0, fields=[{"answer": g} for g in golds])
    finally:
        close_reward_processes()
    np.testing.assert_array_equal(scored.reward, expected)
    assert not scored.failed.any()
