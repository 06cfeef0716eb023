"""Dynamic sampling's refill of uninformative groups, and the extra rounds' prompts, against
hand-worked cases."""

from __future__ import annotations

import numpy as np
import pytest

from stages.advantage import informative_groups
from stages.data import DatasetConfig
from stages.data.source import AdditionPromptSource, FilePromptSource
from stages.data.readers import RawRecord
from stages.rollout.dynamic import fill_informative_groups
from stages.rollout.rows import ROUND_GROUP_STRIDE, first_group_id, rollout_seed

G = 2


def _rows(rewards, tag: int, failed=None) -> dict[str, np.ndarray]:
    """Scored rows of len(rewards) / G groups; ``tokens`` carry ``tag`` and the sample index."""
    n = len(rewards)
    return {"reward": np.asarray(rewards, np.float32),
            "reward_failed": np.zeros(n, bool) if failed is None else np.asarray(failed, bool),
            "tokens": np.stack([np.full(n, tag), np.arange(n), np.zeros(n)], axis=1).astype(np.int32)}


def test_informative_groups_need_a_spread_among_two_scored_samples():
    rewards = np.array([1, 1, 0, 1, 0, 1, 0, 0], np.float32)
    failed = np.array([0, 0, 0, 0, 0, 1, 0, 0], bool)
    # groups: equal; spread; one scored sample left (the other failed); equal
    np.testing.assert_array_equal(informative_groups(rewards, failed, G), [False, True, False, False])


def test_uninformative_slots_are_refilled_in_round_order():
    first = _rows([1, 1, 0, 1, 0, 0], tag=0)  # slots 0 and 2 are uninformative
    calls = []

    def generate(round: int, n: int):
        calls.append((round, n))
        # round 1: [0, 0] then [1, 0] -> its second group fills slot 0; round 2: [0.5, 0] fills slot 2
        return {1: _rows([0, 0, 1, 0], tag=1), 2: _rows([0.5, 0], tag=2)}[round]

    filled = fill_informative_groups(first, generate, G, max_rounds=3)
    assert calls == [(1, 2), (2, 1)]  # as many prompts as slots to fill; stops once all are filled
    tokens = filled.arrays["tokens"]
    np.testing.assert_array_equal(tokens[0:2, :2], [[1, 2], [1, 3]])  # round 1's group 1
    np.testing.assert_array_equal(tokens[2:4, :2], [[0, 2], [0, 3]])  # kept from round 0
    np.testing.assert_array_equal(tokens[4:6, :2], [[2, 0], [2, 1]])  # round 2's group 0
    np.testing.assert_array_equal(filled.arrays["reward"], [1, 0, 0, 1, 0.5, 0])
    assert filled.metrics == {"groups_generated": 6.0, "groups_dropped": 3.0, "groups_unfilled": 0.0,
                              "sampling_rounds": 3.0}
    np.testing.assert_array_equal(first["reward"], [1, 1, 0, 1, 0, 0])  # the input is not modified


def test_the_round_cap_leaves_slots_unfilled_and_says_so():
    first = _rows([1, 1, 0, 0], tag=0)

    def generate(round: int, n: int):
        return _rows([0] * (n * G), tag=round)  # never informative

    filled = fill_informative_groups(first, generate, G, max_rounds=2)
    assert filled.metrics == {"groups_generated": 6.0, "groups_dropped": 4.0, "groups_unfilled": 2.0,
                              "sampling_rounds": 3.0}
    np.testing.assert_array_equal(filled.arrays["tokens"], first["tokens"])  # unfilled slots keep their rows


def test_a_share_with_nothing_to_refill_runs_no_round():
    filled = fill_informative_groups(_rows([1, 0, 0, 1], tag=0), lambda r, n: pytest.fail("no round"), G, 3)
    assert filled.metrics["sampling_rounds"] == 1.0 and filled.metrics["groups_generated"] == 2.0


class _Chars:
    def encode(self, text):
        return [ord(c) for c in text]

    def decode(self, ids):
        return "".join(map(chr, ids))

    def encode_prompt(self, text):
        return [1, *self.encode(text)]


def test_extra_rounds_draw_their_own_deterministic_prompts():
    raw = [RawRecord(f"x.jsonl:line {i + 1}", f"q{i}", str(i)) for i in range(40)]
    cfg = DatasetConfig(kind="jsonl", path="x.jsonl", shuffle=True)
    source = FilePromptSource(cfg, _Chars(), 8, raw)
    base, extra = source.records(3), source.records(3, round=1)
    assert [r.index for r in extra] == [r.index for r in source.records(3, round=1)]  # deterministic
    assert [r.index for r in extra] != [r.index for r in base]
    assert [r.index for r in extra] != [r.index for r in source.records(3, round=2)]
    assert [r.index for r in base] == [r.index for r in FilePromptSource(cfg, _Chars(), 8, raw).records(3)]
    small = [r.index for r in FilePromptSource(cfg, _Chars(), 8, raw[:5]).records(0, round=1)]
    assert len(small) == 8 and small[5:] == small[:3] and sorted(small[:5]) == [0, 1, 2, 3, 4]  # cycled
    addition = AdditionPromptSource(DatasetConfig(), _Chars(), 8)
    assert [r.prompt for r in addition.records(2, round=1)] != [r.prompt for r in addition.records(2)]
    assert [r.prompt for r in addition.records(2, round=1)] == [r.prompt for r in addition.records(2, round=1)]


def test_extra_rounds_have_their_own_seeds_and_group_ids():
    assert rollout_seed(0, 5, 4) == rollout_seed(0, 5, 4, round=0)  # round 0 as before
    seeds = {rollout_seed(0, 5, 4, r) for r in range(4)} | {rollout_seed(0, 5, 8, 1), rollout_seed(1, 5, 4, 1)}
    assert len(seeds) == 6
    assert first_group_id(5, 8, 4, round=2) == 5 * 8 + 4 + 2 * ROUND_GROUP_STRIDE
