"""pass@k, maj@k and the final-answer reader against numbers worked out by hand."""

from __future__ import annotations

import numpy as np
import pytest

from stages.config import ConfigError
from stages.eval import EvalConfig, eval_metrics, final_answer, majority_correct, pass_at_k


@pytest.mark.parametrize("n, c, k, expected", [
    (5, 2, 1, 2 / 5),                  # pass@1 = c / n
    (5, 2, 2, 1 - 3 / 10),             # 1 - C(3, 2) / C(5, 2)
    (5, 2, 3, 1 - 1 / 10),             # 1 - C(3, 3) / C(5, 3)
    (5, 2, 4, 1.0),                    # n - c = 3 < k: every draw of 4 holds a correct one
    (4, 0, 2, 0.0),
    (4, 4, 1, 1.0),
    (10, 3, 5, 1 - 21 / 252),          # 1 - C(7, 5) / C(10, 5)
])
def test_pass_at_k_is_the_unbiased_estimator(n, c, k, expected):
    assert pass_at_k(n, c, k) == pytest.approx(expected, rel=1e-12)


def test_pass_at_k_equals_the_frequency_over_every_draw():
    """The estimator is the share of the C(n, k) draws that hold a correct sample."""
    from itertools import combinations

    correct = [True, False, False, True, False, False]
    for k in range(1, 7):
        draws = list(combinations(range(6), k))
        share = sum(any(correct[i] for i in d) for d in draws) / len(draws)
        assert pass_at_k(6, 2, k) == pytest.approx(share, rel=1e-12)


@pytest.mark.parametrize("bad", [(3, 4, 1), (3, 1, 0), (3, 1, 4)])
def test_pass_at_k_refuses_impossible_counts(bad):
    with pytest.raises(ValueError, match="pass@k"):
        pass_at_k(*bad)


def test_majority_vote_by_hand():
    answers = ["7", "5", "7", None, "5"]
    correct = [True, False, True, False, False]
    assert majority_correct(answers, correct, 3)        # 7, 5, 7: 7 wins, right
    assert majority_correct(answers, correct, 5)        # 7 x2, 5 x2: tie, 7 was given first
    assert majority_correct(answers, correct, 2)        # 7, 5: tie, 7 was given first
    assert not majority_correct(["5", "7", "5"], [False, True, False], 3)  # 5 wins, wrong
    assert not majority_correct(["5", "7", "7"], [False, True, True], 1)   # the first alone: 5
    assert not majority_correct([None, None], [False, False], 2)


def test_final_answers():
    assert final_answer("so 12 + 30 = 42.", "last_number") == "42"
    assert final_answer("it is 1,234", "last_number") == "1234"
    assert final_answer("-3.50 or 4.0", "last_number") == "4"
    assert final_answer("no number", "last_number") is None
    assert final_answer(r"we get \boxed{\frac{1}{2}} and 3", "boxed") == r"\frac{1}{2}"
    assert final_answer(r"\boxed{5} then \boxed{ 6 }", "boxed") == "6"
    assert final_answer("42", "boxed") is None


def test_eval_metrics_by_hand():
    correct = np.array([[True, False, False, True], [False, False, False, False]])  # 2 prompts x n 4
    reward = np.array([1, 0, 0, 1, 0, 0, 0, 0], np.float32)
    answers = ["3", "4", "4", "3", None, "9", "9", None]
    length = np.array([2, 4, 4, 2, 6, 3, 3, 6])
    truncated = np.array([0, 0, 0, 0, 1, 0, 0, 1], bool)
    m = eval_metrics(correct, reward, answers, length, truncated, ks=(2, 4), prefix="eval_")
    assert m["eval_accuracy"] == pytest.approx((2 / 4 + 0) / 2)
    assert m["eval_pass_at_2"] == pytest.approx((1 - 1 / 6 + 0) / 2)        # 1 - C(2, 2) / C(4, 2)
    assert m["eval_pass_at_4"] == pytest.approx(0.5)
    assert m["eval_maj_at_2"] == pytest.approx(0.5)   # prompt 0: 3, 4 tie -> 3 (first), right
    assert m["eval_maj_at_4"] == pytest.approx(0.5)   # prompt 0: 3 x2, 4 x2 -> 3; prompt 1: 9, wrong
    assert m["eval_format_rate"] == pytest.approx(6 / 8)
    assert m["eval_length_mean"] == pytest.approx(30 / 8)
    assert m["eval_truncation_rate"] == pytest.approx(2 / 8)
    assert m["eval_reward_mean"] == pytest.approx(2 / 8)


@pytest.mark.parametrize("fields, key", [
    (dict(path="x.jsonl", num_samples=2, ks=[3]), "eval.ks"),
    (dict(path="x.jsonl", greedy=False, num_samples=0), "eval"),
    (dict(path="x.jsonl", answer_format="xml"), "eval.answer_format"),
    (dict(every_steps=-1), "eval.every_steps"),
])
def test_bad_eval_keys_name_the_key(fields, key):
    with pytest.raises(ConfigError, match=key):
        EvalConfig(**fields)


def test_versions_due():
    cfg = EvalConfig(path="x.jsonl", every_steps=3)
    assert [v for v in range(11) if cfg.due(v, 10)] == [0, 3, 6, 9, 10]
    assert not any(EvalConfig().due(v, 10) for v in range(11))
