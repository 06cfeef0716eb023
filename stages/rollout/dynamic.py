"""Dynamic sampling (DAPO, Yu et al. 2025; ``rollout.dynamic_sampling``): an engine's share of a
step keeps only groups whose rewards carry a signal.

A group whose scored rewards are all equal (or that has fewer than two scored samples) has zero
advantage everywhere: it costs a training pass and teaches nothing. After the share's groups are
generated and scored, each such slot is refilled from an extra round of as many prompts as there
are such slots (round r of the step draws its own prompts and seed: stages/data/source.py,
stages/rollout/rows.py), taking that round's informative groups in order, until every slot holds
an informative group or ``max_rounds`` extra rounds have run. A slot left unfilled keeps its
uninformative group (zero advantage). Everything is a function of the rows each round returns, so
with deterministic rounds the filled rows are deterministic too.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np

from stages.advantage import informative_groups

__all__ = ["FilledGroups", "fill_informative_groups"]

Round = Callable[[int, int], dict[str, np.ndarray]]
"""(round r >= 1, number of prompts n) -> the scored rows of n groups of that round: every
per-sample array of the share's rows ([n * G, ...]), reward and reward_failed included."""


@dataclass(frozen=True)
class FilledGroups:
    arrays: dict[str, np.ndarray]
    """The share's rows, uninformative groups replaced where a round gave an informative one."""
    metrics: dict[str, float]
    """groups_generated (all rounds), groups_dropped (generated, not kept), groups_unfilled (slots
    still uninformative), sampling_rounds (1 + the extra rounds run)."""


def fill_informative_groups(first: dict[str, np.ndarray], generate: Round, group_size: int,
                            max_rounds: int) -> FilledGroups:
    """Refill the uninformative groups of ``first`` (the share's scored rows, G rows per group
    contiguous) from up to ``max_rounds`` extra rounds of ``generate``."""
    G = group_size
    arrays = {k: np.array(v, copy=True) for k, v in first.items()}
    lengths = {len(v) for v in arrays.values()}
    if len(lengths) != 1 or next(iter(lengths)) % G:
        raise ValueError(f"rows of {sorted(lengths)} samples are not whole groups of {G} in every array")
    keep = informative_groups(arrays["reward"], arrays["reward_failed"], G)
    slots, generated, rounds = len(keep), len(keep), 0
    for r in range(1, max_rounds + 1):
        need = np.flatnonzero(~keep)
        if not len(need):
            break
        extra = generate(r, len(need))
        rounds, generated = r, generated + len(need)
        found = np.flatnonzero(informative_groups(extra["reward"], extra["reward_failed"], G))
        for slot, group in zip(need, found):
            for name, values in arrays.items():
                values[slot * G:(slot + 1) * G] = extra[name][group * G:(group + 1) * G]
            keep[slot] = True
    metrics = {"groups_generated": float(generated), "groups_dropped": float(generated - slots),
               "groups_unfilled": float((~keep).sum()), "sampling_rounds": float(1 + rounds)}
    return FilledGroups(arrays, metrics)
