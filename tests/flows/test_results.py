"""The tasks' typed results (flows/results.py): what a stage's mark stores, and what a resumed step
reads back from it, are the same result."""

import json

import numpy as np
import pytest

from flows.results import (AdvantageResult, ProximalResult, ReferenceResult, RolloutResult, ScoreResult, TaskSpan,
                           TrainResult, result_of_stage)

_ROLLOUT = dict(rollout_tokens=412.0, rollout_seconds=0.25, rollout_tokens_per_s=1648.0, kv_cache_bytes=8192.0,
                weights_from="memory", weight_load_seconds=0.01, task_start=100.0, task_end=100.5)


def _stored(result) -> dict:
    """As the Zarr attrs hold it: through JSON."""
    return json.loads(json.dumps(result.to_dict()))


def test_every_result_reads_back_as_it_was_stored():
    results = {
        "rollout": RolloutResult(**_ROLLOUT, weight_sync_memory_receive_bytes=np.int64(751_288),
                                 reward_seconds=0.05, reward_failed=np.float32(2.0), reward_first_error="timeout",
                                 reward_functions={"exact": {"sum": 3.0, "scored": 6, "failed": 2, "first_error": ""}}),
        "reward": ScoreResult(statistics={"reward_mean": 0.5, "reward_failed": 1.0}, reward_first_error="boom",
                              reward_functions={"exact": {"sum": 1.0, "scored": 2, "failed": 0, "first_error": ""}}),
        "advantage": AdvantageResult(statistics={"reward_mean": 0.5, "zero_variance_groups": 3.0}),
        "reference": ReferenceResult(reference_seconds=0.3, rank=1, task_start=1.0, task_end=1.4),
        "proximal": ProximalResult(proximal_seconds=0.2, rank=0, task_start=2.0, task_end=2.2),
        "train": TrainResult(rank=1, metrics={"loss": 0.25, "bubble_fraction": 0.1}, window_ns=[5, 9],
                             shard_bytes=1024, shard_seconds=0.02, task_start=3.0, task_end=4.0,
                             weight_sync_memory_send_seconds=0.1, weight_sync_memory_send_bytes=1024,
                             weight_sync_memory_send_hash_seconds=0.01, weight_sync_memory_send_failed=0,
                             tied_sha256="ab" * 32),
        "publish": TaskSpan(task_start=5.0, task_end=5.5),
    }
    for stage, result in results.items():
        assert result_of_stage(stage, _stored(result)) == result, stage
    # numpy scalars are stored as plain numbers, of the same value
    assert _stored(results["rollout"])["weight_sync_memory_receive_bytes"] == 751_288
    assert type(_stored(results["rollout"])["reward_failed"]) is float


def test_what_is_not_measured_or_stays_in_timelines_is_not_stored():
    rollout = _stored(RolloutResult(**_ROLLOUT))
    assert set(rollout) == set(_ROLLOUT)  # no None fields
    passed = ReferenceResult(reference_seconds=0.3, rank=1, task_start=1.0, task_end=1.4)
    train = TrainResult(rank=1, metrics={}, window_ns=(0, 1), shard_bytes=0, shard_seconds=0.0, task_start=0.0,
                        task_end=1.0, events=[{"ph": "X", "ts": 3}], reference_seconds=0.3, reference=passed)
    stored = _stored(train)
    assert "events" not in stored and "reference" not in stored and stored["reference_seconds"] == 0.3
    back = result_of_stage("train", stored)
    assert back.events == [] and back.reference is None and back.window_ns == [0, 1]


def test_a_scoring_result_marked_as_the_advantage_stage_gives_only_its_statistics():
    """One scoring task marks reward and advantage with its result: the advantage stage's result
    read back holds the statistics alone, not the first error or the functions' sums."""
    score = ScoreResult(statistics={"reward_mean": 0.5, "reward_failed": 1.0}, reward_first_error="boom",
                        reward_functions={"exact": {"sum": 1.0, "scored": 2, "failed": 0, "first_error": ""}})
    assert result_of_stage("advantage", _stored(score)) == AdvantageResult(statistics=score.statistics)
    assert score.reward_failed == 1.0


def test_scores_inside_the_rollout_are_the_reward_stages_result():
    rollout = RolloutResult(**_ROLLOUT, reward_seconds=0.05, reward_failed=2.0, reward_first_error="",
                            reward_functions={})
    assert rollout.scores() == ScoreResult(statistics={"reward_failed": 2.0})
    # A step stored by an older version kept the rollout tasks' whole results as the reward stage's.
    old = result_of_stage("reward", _stored(rollout))
    assert old.reward_failed == 2.0 and old.reward_first_error == "" and old.reward_functions == {}


def test_a_task_cannot_return_a_measurement_without_a_field_but_a_stored_one_is_read_past():
    with pytest.raises(TypeError, match="speculative_rate"):
        RolloutResult(**_ROLLOUT, speculative_rate=0.5)
    stored = {**_ROLLOUT, "a_key_this_version_dropped": 1.0}
    assert result_of_stage("rollout", stored) == RolloutResult(**_ROLLOUT)
    with pytest.raises(TypeError, match="rank"):  # a required field missing is not defaulted
        TrainResult.from_dict({"metrics": {}})
