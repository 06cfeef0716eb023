"""Held-out metrics of one policy version: pass@k by the unbiased estimator, maj@k, format rate.

pass@k (Chen et al. 2021, "Evaluating Large Language Models Trained on Code", eq. 1): with n
samples of a prompt of which c are correct, the chance that k drawn without replacement hold at
least one correct one is ``1 - C(n - c, k) / C(n, k)``, averaged over prompts; pass@1 = c / n.
maj@k: the answer most of a prompt's first k samples give (ties: the one given first) is right.
"""

from __future__ import annotations

import re
from collections import Counter
from math import comb
from typing import Optional, Sequence

import numpy as np

__all__ = ["pass_at_k", "majority_correct", "final_answer", "eval_metrics"]

_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k of one prompt with ``c`` correct of ``n`` samples."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n, got n={n}, c={c}, k={k}")
    if n - c < k:  # every draw of k holds a correct sample
        return 1.0
    return 1.0 - comb(n - c, k) / comb(n, k)


def majority_correct(answers: Sequence[Optional[str]], correct: Sequence[bool], k: int) -> bool:
    """Whether the most frequent answer among the first ``k`` samples (None, no answer, never
    wins) is a correct one."""
    votes = Counter(a for a in answers[:k] if a is not None)
    if not votes:
        return False
    top = max(votes.values())
    winner = next(a for a in answers[:k] if a is not None and votes[a] == top)  # first given among the tied
    return any(ok for a, ok in zip(answers[:k], correct[:k]) if a == winner)


def _boxed(text: str) -> Optional[str]:
    """Contents of the last ``\\boxed{...}``, braces balanced."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    depth, i = 0, start + len("\\boxed")
    for j in range(i, len(text)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return text[i + 1: j].strip()
    return None


def final_answer(text: str, answer_format: str) -> Optional[str]:
    """The completion's final answer as a vote key (numbers without thousands separators), or None
    when it gives none in ``answer_format`` ("last_number" or "boxed")."""
    found = _boxed(text) if answer_format == "boxed" else (_NUMBER.findall(text) or [None])[-1]
    if found is None:
        return None
    plain = found.replace(",", "").strip()
    try:  # "42.0" and "42" are one answer
        value = float(plain)
        return str(int(value)) if value.is_integer() else str(value)
    except ValueError:
        return plain


def eval_metrics(correct: np.ndarray, reward: np.ndarray, answers: list[Optional[str]], length: np.ndarray,
                 truncated: np.ndarray, ks: Sequence[int], prefix: str) -> dict[str, float]:
    """Metrics of [num_prompts, n] arrays (n samples per prompt, ``answers`` flat, row-major):
    ``{prefix}accuracy`` (pass@1), ``pass_at_{k}`` and ``maj_at_{k}`` for n > 1, mean reward,
    format rate (share with an answer), mean length, truncation rate."""
    num_prompts, n = correct.shape
    per_prompt = [answers[i * n: (i + 1) * n] for i in range(num_prompts)]
    out = {f"{prefix}accuracy": float(np.mean([pass_at_k(n, int(c), 1) for c in correct.sum(1)]))}
    if n > 1:
        for k in ks:
            out[f"{prefix}pass_at_{k}"] = float(np.mean([pass_at_k(n, int(c), k) for c in correct.sum(1)]))
            out[f"{prefix}maj_at_{k}"] = float(np.mean([majority_correct(a, row, k)
                                                        for a, row in zip(per_prompt, correct.tolist())]))
    out[f"{prefix}reward_mean"] = float(reward.mean())
    out[f"{prefix}format_rate"] = float(np.mean([a is not None for a in answers]))
    out[f"{prefix}length_mean"] = float(length.mean())
    out[f"{prefix}truncation_rate"] = float(truncated.mean())
    return out
