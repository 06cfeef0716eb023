"""How many torch threads each phase's tasks get (flows/tasks.py phase_threads), worked by hand."""

from __future__ import annotations

import pytest

from flows.config import load_config
from flows.worker import phase_threads


_DECOUPLED = ["cluster.placement=decoupled", "rollout.num_engines=1"]


@pytest.mark.parametrize("overrides, cores, rollout, train", [
    (_DECOUPLED, 2, 2, 1),  # sync, decoupled: 1 engine takes both cores; 2 ranks share them
    (_DECOUPLED, 8, 8, 4),
    ([*_DECOUPLED, "rollout.max_staleness=1"], 2, 1, 1),  # steps overlap: 1 engine + 2 ranks busy at once
    ([*_DECOUPLED, "rollout.max_staleness=1"], 6, 2, 2),
    # Colocated, sync: the ranks wait while the one engine generates, so it takes every core.
    (["cluster.placement=colocated", "rollout.num_engines=1"], 4, 4, 2),
    # Colocated, steps overlapping: rank 1 may run its share of a pass while rank 0's engine generates.
    (["cluster.placement=colocated", "rollout.num_engines=1", "rollout.max_staleness=1"], 4, 2, 2),
    ([], 2, 1, 1),  # the tiny config: 2 engines in the 2 training workers, 2 ranks
    ([], 8, 4, 4),
    ([*_DECOUPLED, "cluster.rollout_threads=3", "cluster.train_threads=1"], 8, 3, 1),  # fixed counts win
])
def test_threads_per_phase(overrides, cores, rollout, train):
    cfg = load_config("configs/tiny.yaml", overrides)
    assert phase_threads(cfg, "rollout", cores) == rollout
    assert phase_threads(cfg, "train", cores) == train
    assert phase_threads(cfg, "reward", cores) == 1
