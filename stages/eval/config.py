"""The ``eval:`` section: held-out prompts, how to sample them, what counts as correct."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Optional

from stages.config import ConfigError, require

__all__ = ["ANSWER_FORMATS", "EvalConfig"]

ANSWER_FORMATS = ("last_number", "boxed")


@dataclass(frozen=True, kw_only=True, slots=True)
class EvalConfig:
    path: Optional[str] = None
    """Held-out prompts (JSONL or Parquet, the dataset section's fields), never trained on; unset:
    no evaluation. Evaluated: the base policy v0 before step 0, every ``every_steps`` versions and
    the last version, on a worker of their own (the embedded cluster starts ``eval-0``; on an
    existing cluster, workers with the ``eval`` resource, else flows/evaluate.py ``eval_workers``)."""
    prompt_field: str = "prompt"
    """Field holding the prompt text."""
    answer_field: str = "answer"
    """Field holding the ground truth, passed to the reward functions as ``answer=``."""
    num_prompts: Optional[int] = None
    """The first this many records of the file; unset: all."""
    every_steps: int = 0
    """Also evaluate every version v with v % every_steps == 0; 0: the base and the last only."""
    greedy: bool = True
    """One greedy completion per prompt (top-1 token at each position): ``eval_greedy_accuracy``."""
    num_samples: int = 0
    """Sampled completions per prompt (rollout.temperature, top_p, top_k): the unbiased pass@k
    estimator and maj@k over them; 0: none."""
    ks: list[int] = field(default_factory=lambda: [1])
    """The k of pass@k and maj@k (each <= num_samples)."""
    max_new_tokens: Optional[int] = None
    """Completion limit; unset: rollout.max_new_tokens."""
    functions: Optional[list[str]] = None
    """Reward functions that judge correctness (summed); unset: reward.functions."""
    correct_reward: float = 1.0
    """A completion is correct when its summed reward reaches this."""
    answer_format: str = "last_number"
    """How the final answer is read from a completion, for maj@k votes and the format rate:
    ``last_number`` (the last number in the text) or ``boxed`` (the last ``\\boxed{...}``)."""
    seed: int = 0
    """Seed of the sampled completions (with the version): a version's evaluation is reproducible."""

    def __post_init__(self) -> None:
        require(self.num_prompts is None or self.num_prompts >= 1, "eval.num_prompts must be >= 1 (unset: all)")
        require(self.every_steps >= 0, "eval.every_steps must be >= 0 (0: the base and the last version)")
        require(self.num_samples >= 0, "eval.num_samples must be >= 0")
        require(self.path is None or self.greedy or self.num_samples > 0,
                 "eval: set eval.greedy=true or eval.num_samples >= 1, or unset eval.path")
        require(all(1 <= k <= max(self.num_samples, 1) for k in self.ks) and (self.num_samples or self.ks == [1]),
                 f"eval.ks={list(self.ks)}: each k must be in [1, eval.num_samples={self.num_samples}]")
        require(self.max_new_tokens is None or self.max_new_tokens >= 1, "eval.max_new_tokens must be >= 1")
        require(self.answer_format in ANSWER_FORMATS,
                 f"eval.answer_format={self.answer_format!r} is not one of {', '.join(ANSWER_FORMATS)}")
        require(math.isfinite(self.correct_reward), f"eval.correct_reward={self.correct_reward} must be finite")
        if self.functions is not None:  # found now, not after the training the run does first
            from stages.reward import RewardFunctionError, check_reward_functions

            require(len(self.functions) >= 1, "eval.functions is empty: name a reward, or unset it (reward.functions)")
            try:
                check_reward_functions(self.functions)
            except RewardFunctionError as exc:
                raise ConfigError(f"eval.{str(exc).removeprefix('reward.')}") from None

    @property
    def enabled(self) -> bool:
        return self.path is not None

    def due(self, version: int, last_version: int) -> bool:
        """Whether policy ``version`` is evaluated in a run whose last version is ``last_version``."""
        if not self.enabled:
            return False
        return version in (0, last_version) or (self.every_steps > 0 and version % self.every_steps == 0)
