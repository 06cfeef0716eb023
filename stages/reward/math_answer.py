"""A math-answer reward: the completion's final answer equals the ground truth, symbolically.

Built on ``math-verify``, which extracts the answer from the completion (a ``\\boxed{}`` first, else
the last number or expression, LaTeX or plain), normalises it (thousands commas, units, percent,
``$``) and compares it with the gold answer symbolically with sympy, so ``1/2`` equals ``0.5`` and
``\\frac{14}{2}`` equals ``7``.
"""

from __future__ import annotations

import threading
from typing import Optional

from stages.reward import register_reward

__all__ = ["math_answer", "MATH_VERIFY_TIMEOUT_S"]

MATH_VERIFY_TIMEOUT_S = 2
"""Seconds math-verify may spend parsing or comparing (its SIGALRM limit, main thread only); the
reward process's own per-sample limit stops anything that still hangs."""


@register_reward("math_answer")
def math_answer(prompt: str, completion: str, answer: Optional[str] = None) -> float:
    """1.0 if the completion's final answer equals ``answer`` (math-verify), else 0.0."""
    if answer is None:
        raise ValueError("math_answer needs the ground truth: set dataset.answer_field")
    from math_verify import parse, verify

    # math-verify's limit uses SIGALRM, which only the main thread may set.
    limit = MATH_VERIFY_TIMEOUT_S if threading.current_thread() is threading.main_thread() else None
    gold = parse(answer, parsing_timeout=limit)
    got = parse(completion, parsing_timeout=limit)
    if not gold or not got:
        return 0.0
    return 1.0 if verify(gold, got, timeout_seconds=limit) else 0.0
