"""Reward functions (a registry) and time-limited, fault-tolerant scoring of whole groups.

A reward function maps (prompt text, completion text) to a float. It never evaluates model output
as code. A function that raises, runs past its time limit or returns a non-finite value gives the
sample reward 0 and a ``failed`` flag, counted in the metrics; the iteration goes on.
"""

from __future__ import annotations

import math
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from typing import Callable

import numpy as np

from stages.tasks.addition import answer_of

__all__ = ["RewardFn", "REWARDS", "register_reward", "get_reward", "ScoredGroups", "score_samples"]

RewardFn = Callable[[str, str], float]
REWARDS: dict[str, RewardFn] = {}


def register_reward(name: str) -> Callable[[RewardFn], RewardFn]:
    def wrap(fn: RewardFn) -> RewardFn:
        if name in REWARDS:
            raise ValueError(f"reward {name!r} is already registered")
        REWARDS[name] = fn
        return fn
    return wrap


def get_reward(name: str) -> RewardFn:
    if name not in REWARDS:
        raise KeyError(f"reward {name!r} is not registered; known: {', '.join(sorted(REWARDS))}")
    return REWARDS[name]


@register_reward("exact_match")
def exact_match(prompt: str, completion: str) -> float:
    """1 if the completion is exactly the sum, else 0."""
    return 1.0 if completion.strip() == answer_of(prompt) else 0.0


@register_reward("digit_match")
def digit_match(prompt: str, completion: str) -> float:
    """Share of the answer's digits right in place (right-aligned), minus a penalty per extra char."""
    answer, got = answer_of(prompt), completion.strip()
    right = sum(a == b for a, b in zip(reversed(answer), reversed(got)))
    return right / len(answer) - 0.1 * max(0, len(got) - len(answer))


@dataclass(frozen=True)
class ScoredGroups:
    reward: np.ndarray  # [N] float32
    failed: np.ndarray  # [N] bool


def score_samples(prompts: list[str], completions: list[str], functions: list[str],
                  timeout_s: float) -> ScoredGroups:
    """Sum of the named reward functions for each sample, each call limited to ``timeout_s``."""
    fns = [get_reward(name) for name in functions]
    reward = np.zeros(len(prompts), dtype=np.float32)
    failed = np.zeros(len(prompts), dtype=bool)
    # One worker thread: a reward that runs past its limit is abandoned (threads cannot be
    # killed) and the rest are scored on a fresh thread.
    pool = ThreadPoolExecutor(max_workers=1)
    try:
        for i, (prompt, completion) in enumerate(zip(prompts, completions)):
            total = 0.0
            for fn in fns:
                future = pool.submit(fn, prompt, completion)
                try:
                    value = float(future.result(timeout=timeout_s))
                except FutureTimeout:
                    pool.shutdown(wait=False, cancel_futures=True)
                    pool = ThreadPoolExecutor(max_workers=1)
                    value = math.nan
                except Exception:
                    value = math.nan
                if not math.isfinite(value):
                    failed[i] = True
                    total = 0.0
                    break
                total += value
            reward[i] = total
    finally:
        pool.shutdown(wait=False)
    return ScoredGroups(reward, failed)
