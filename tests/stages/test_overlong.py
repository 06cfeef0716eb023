"""Overlong completions: DAPO's soft penalty added to the reward, truncated samples masked out of
the loss (train.overlong=mask), and the truncation rate of a step, against hand-worked numbers."""

from __future__ import annotations

import numpy as np
import pytest

from flows.config import load_config
from stages.config import ConfigError, RewardConfig
from stages.data import PromptRecord
from stages.policy.tokenizer import TextCodec
from stages.reward import overlong_penalty
from stages.rollout.engine import FINISH_LENGTH, FINISH_STOP
from stages.reward.rows import reward_statistics, score_rows
from stages.tasks.addition import make_tokenizer_json
from stages.train.batch import _trained, aggregation_weights, build_global_batch
from stages.train.loss import TARGET_FIELDS
from test_microbatch_plan import make_arrays

_MASK, _W = TARGET_FIELDS.index("mask"), TARGET_FIELDS.index("weight")


def test_the_penalty_ramps_over_the_buffer():
    # max_new_tokens 10, buffer 4: free up to 6 tokens, then -1/4 per token down to -1 at 10.
    length = np.array([0, 3, 6, 7, 8, 9, 10])
    np.testing.assert_array_equal(overlong_penalty(length, 10, 4, 1.0), [0, 0, 0, -0.25, -0.5, -0.75, -1.0])
    np.testing.assert_array_equal(overlong_penalty(length, 10, 4, 0.5), [0, 0, 0, -0.125, -0.25, -0.375, -0.5])
    assert not overlong_penalty(length, 10, 0, 1.0).any()  # buffer 0: off
    with pytest.raises(ValueError, match="below rollout.max_new_tokens=10"):
        overlong_penalty(length, 10, 10, 1.0)


def test_scored_rewards_carry_the_penalty_and_failed_ones_do_not():
    codec = TextCodec.from_json(make_tokenizer_json())
    new = 6
    answers = ["19", "19", "1919"]  # right and short, right and short, wrong and 5 tokens with EOS
    rows = {"tokens": np.full((3, new), codec.pad_id, np.int32), "length": np.zeros(3, np.int32)}
    for i, a in enumerate(answers):
        out = [*codec.encode(a), codec.eos_id]
        rows["tokens"][i, :len(out)], rows["length"][i] = out, len(out)
    records = [PromptRecord(0, "12+7=", (codec.bos_id,), "19")]
    plain = score_rows(codec, rows, records, 3, RewardConfig(functions=["exact_match"]))
    np.testing.assert_array_equal(plain.reward, [1.0, 1.0, 0.0])
    # Buffer 3 of 6: lengths 3, 3, 5 -> penalties 0, 0, -2/3 (x 0.5).
    scored = score_rows(codec, rows, records, 3, RewardConfig(functions=["exact_match"], overlong_buffer=3,
                                                              overlong_penalty=0.5))
    np.testing.assert_allclose(scored.reward, [1.0, 1.0, -1 / 3], rtol=1e-6)


def test_truncated_fraction_counts_length_finishes():
    reward = np.array([1, 0, 1, 1], np.float32)
    finish = np.array([FINISH_STOP, FINISH_LENGTH, FINISH_STOP, FINISH_LENGTH], np.int8)
    stats = reward_statistics(reward, np.full(4, 3), 2, finish_reason=finish)
    assert stats["truncated_fraction"] == 0.5
    assert "truncated_fraction" not in reward_statistics(reward, np.full(4, 3), 2)


def test_masked_truncated_samples_leave_the_loss_and_its_denominators():
    G, groups, Pw, Gw = 4, 3, 5, 7
    rng = np.random.default_rng(0)
    length = rng.integers(1, Gw + 1, G * groups)
    a = make_arrays(np.full(G * groups, 3), length, Pw, Gw, seed=0)
    failed = np.zeros(G * groups, bool)
    failed[1] = True
    truncated = length == Gw
    assert truncated.any() and not truncated.all()
    batch = build_global_batch(a, "token-mean", 0, None, reward_failed=failed, group_size=G, untrained=truncated)
    target = batch.target.numpy()
    trained = _trained(failed, G) & ~truncated
    for i in range(G * groups):  # layout None: sample i is row i, its completion after its prompt
        n = int(length[i])
        assert (target[i, 2:2 + n, _MASK] == float(trained[i])).all(), i
    # token-mean: every trained token weighs 1 / (the trained tokens), the masked ones are not counted.
    weights = aggregation_weights(length.astype(np.int64), Gw, "token-mean", trained)
    np.testing.assert_allclose(weights[trained], 1.0 / length[trained].sum())
    np.testing.assert_allclose(target[..., _W][target[..., _MASK] > 0].sum(), 1.0, rtol=1e-6)


@pytest.mark.parametrize("override, message", [
    ("train.overlong=drop", "train.overlong='drop' is not one of keep, mask"),
    ("reward.overlong_buffer=6", "reward.overlong_buffer=6 must be below rollout.max_new_tokens=6"),
    ("reward.overlong_buffer=-1", "reward.overlong_buffer=-1 must be >= 0"),
])
def test_bad_overlong_settings_are_refused(override, message):
    with pytest.raises(ConfigError) as info:
        load_config("configs/tiny.yaml", [override])
    assert message in str(info.value) and "\n" not in str(info.value)
