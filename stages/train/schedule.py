"""The learning-rate schedule: the rate of optimiser step ``step`` as a pure function of the step.

A resumed run sets each step's rate from its step index alone (flows/tasks.py ``train_task``), so
it trains at exactly the rates the uninterrupted run did (AdamW's saved state holds no rate).
Torch-free: stages/config.py validates ``train.lr_schedule`` against :data:`LR_SCHEDULES`.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from stages.config import TrainConfig

__all__ = ["LR_SCHEDULES", "lr_at"]

LR_SCHEDULES = ("constant", "linear", "cosine")


def lr_at(train: TrainConfig, step: int, iterations: int, lr: float | None = None) -> float:
    """The rate of 0-based step ``step`` of a run of ``iterations`` steps, peak ``lr`` (train.lr
    resolved, GRPOConfig.lr; default train.lr, which must then be a number).

    With W = lr_warmup_steps, D = lr_decay_steps (unset: max(iterations - W, 1)) and the floor
    f = lr x lr_min_ratio:

    - warm-up, step < W: lr x (step + 1) / (W + 1), a ramp whose first step is not at rate 0;
    - after it, with t = min((step - W) / D, 1): constant lr; linear f + (lr - f) x (1 - t);
      cosine f + (lr - f) x (1 + cos(pi t)) / 2.

    t = 1 from step W + D on: the rate stays at the floor. With D unset the run's last step is
    W + D - 1, so it still trains above the floor.
    """
    lr, warmup = train.lr if lr is None else lr, train.lr_warmup_steps
    if not isinstance(lr, (int, float)):
        raise ValueError(f"train.lr={lr!r} is unresolved: pass the resolved rate (GRPOConfig.lr)")
    # 1) linear warm-up
    if step < warmup:
        return lr * (step + 1) / (warmup + 1)
    if train.lr_schedule == "constant":
        return lr
    # 2) decay from lr to the floor over D steps, 3) the floor after them
    decay = train.lr_decay_steps if train.lr_decay_steps is not None else max(iterations - warmup, 1)
    t = min((step - warmup) / decay, 1.0)
    floor = lr * train.lr_min_ratio
    if train.lr_schedule == "linear":
        return floor + (lr - floor) * (1.0 - t)
    return floor + (lr - floor) * 0.5 * (1.0 + math.cos(math.pi * t))
