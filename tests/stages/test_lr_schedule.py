"""The learning-rate schedule (stages/train/schedule.py ``lr_at``) against rates worked out by hand,
and the train.lr_* keys TrainConfig refuses in one line."""

from __future__ import annotations

import math

import pytest

from stages.config import ConfigError, TrainConfig
from stages.train.schedule import lr_at


def _train(**kw) -> TrainConfig:
    return TrainConfig(**{"lr": 1e-3, **kw})


def _rates(train: TrainConfig, iterations: int) -> list[float]:
    return [lr_at(train, step, iterations) for step in range(iterations)]


def test_constant_is_lr_at_every_step():
    assert _rates(_train(), 5) == [1e-3] * 5


def test_constant_with_warmup_ramps_then_stays():
    # W = 3: lr x 1/4, 2/4, 3/4, then lr.
    assert _rates(_train(lr_warmup_steps=3), 6) == pytest.approx([0.25e-3, 0.5e-3, 0.75e-3, 1e-3, 1e-3, 1e-3])


def test_linear_decays_to_the_floor_and_stays():
    # W = 1, D = 4, floor 0.2 x lr = 2e-4: step 0 is lr / 2; steps 1..4 are t = 0, 1/4, 2/4, 3/4,
    # 2e-4 + 8e-4 x (1 - t); from step 5 = W + D on, the floor.
    train = _train(lr_schedule="linear", lr_warmup_steps=1, lr_decay_steps=4, lr_min_ratio=0.2)
    expected = [0.5e-3, 1e-3, 0.8e-3, 0.6e-3, 0.4e-3, 0.2e-3, 0.2e-3, 0.2e-3]
    assert _rates(train, 8) == pytest.approx(expected)


def test_cosine_hand_worked():
    # W = 0, D = 4, floor 1e-4: t = 0, 1/4, 1/2, 3/4, 1 -> floor + 9e-4 x (1 + cos(pi t)) / 2.
    train = _train(lr_schedule="cosine", lr_decay_steps=4, lr_min_ratio=0.1)
    half_sqrt2 = math.sqrt(2) / 2
    expected = [1e-3, 1e-4 + 9e-4 * (1 + half_sqrt2) / 2, 1e-4 + 9e-4 * 0.5, 1e-4 + 9e-4 * (1 - half_sqrt2) / 2,
                1e-4, 1e-4]
    assert _rates(train, 6) == pytest.approx(expected)
    assert lr_at(train, 2, 6) == pytest.approx(5.5e-4)  # the midpoint: halfway between lr and the floor
    assert lr_at(train, 1000, 6) == pytest.approx(1e-4)  # long after the window: the floor


def test_decay_steps_unset_spans_the_run_after_warmup():
    # iterations 6, W = 2: D = 4, so step 2 + 4 = 6 (one past the run) would reach the floor 0;
    # the run's last step, 5, is t = 3/4: lr x 1/4.
    train = _train(lr_schedule="linear", lr_warmup_steps=2)
    assert _rates(train, 6) == pytest.approx([1e-3 / 3, 2e-3 / 3, 1e-3, 0.75e-3, 0.5e-3, 0.25e-3])
    assert _rates(train, 6) == _rates(_train(lr_schedule="linear", lr_warmup_steps=2, lr_decay_steps=4), 6)
    # A warm-up as long as the run leaves a window of one step, not a division by zero.
    assert lr_at(_train(lr_schedule="cosine", lr_warmup_steps=3), 3, 3) == pytest.approx(1e-3)


@pytest.mark.parametrize("kw, key", [
    ({"lr_schedule": "step"}, "train.lr_schedule"),
    ({"lr_warmup_steps": -1}, "train.lr_warmup_steps"),
    ({"lr_schedule": "cosine", "lr_decay_steps": 0}, "train.lr_decay_steps"),
    ({"lr_schedule": "linear", "lr_min_ratio": 1.5}, "train.lr_min_ratio"),
    ({"lr_schedule": "linear", "lr_min_ratio": -0.1}, "train.lr_min_ratio"),
    ({"lr_schedule": "linear", "lr_min_ratio": float("nan")}, "train.lr_min_ratio"),
    ({"lr_decay_steps": 10}, "train.lr_schedule=constant"),
    ({"lr_min_ratio": 0.1}, "train.lr_schedule=constant"),
])
def test_bad_values_are_refused_in_one_line(kw, key):
    with pytest.raises(ConfigError) as info:
        _train(**kw)
    assert key in str(info.value) and "\n" not in str(info.value)


def test_a_resume_that_would_change_a_decaying_schedule_is_refused(tmp_path):
    """With lr_decay_steps unset, linear / cosine decay over iterations: extending such a run would
    change the rates of the steps still to run, so preflight refuses it in one line; a constant
    schedule, or a set lr_decay_steps, may be extended."""
    from types import SimpleNamespace

    from flows.config import load_config
    from flows.preflight import PreflightError, _check_config
    from flows.config import config_to_dict

    def cfg(*extra):
        return load_config("configs/tiny.yaml", [f"runs_dir={tmp_path}", *extra])

    folder = SimpleNamespace(run_state="run.json", root=str(tmp_path))
    cosine = ["train.lr_schedule=cosine"]
    stored = {"config": config_to_dict(cfg("iterations=4", *cosine))}
    with pytest.raises(PreflightError, match=r"iterations=6 differs from the run's 4, .*--new") as info:
        _check_config(cfg("iterations=6", *cosine), stored, folder)
    assert "\n" not in str(info.value)
    _check_config(cfg("iterations=4", *cosine), stored, folder)  # unchanged: fine
    fixed = [*cosine, "train.lr_decay_steps=4"]
    _check_config(cfg("iterations=6", *fixed), {"config": config_to_dict(cfg("iterations=4", *fixed))}, folder)
    _check_config(cfg("iterations=6"), {"config": config_to_dict(cfg("iterations=4"))}, folder)
