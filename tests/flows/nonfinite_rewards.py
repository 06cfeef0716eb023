"""Reward functions that never return a finite number, for the bad-input catalogue. A module of its
own: the reward process imports it, and it needs nothing heavier than ``math``."""

import math


def nan_reward(prompt: str, completion: str) -> float:
    """A reward that is never finite: its samples are marked failed, never trained on."""
    return math.nan


def inf_reward(prompt: str, completion: str) -> float:
    return -math.inf


def raising_reward(prompt: str, completion: str) -> float:
    """A reward that fails on every sample, with a message the run must show."""
    raise RuntimeError("the grader is broken")
