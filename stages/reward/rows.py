"""Rewards of stored rollout rows: their completions decoded, scored against their prompt records
(stages/reward ``score_samples``), and the step's reward statistics. Arrays in, values out; no IO
(flows/tasks.py reads and writes the rows through storage/).
"""

from __future__ import annotations

import dataclasses
from typing import Optional, Sequence

import numpy as np

from stages.advantage import trained_samples
from stages.config import RewardConfig
from stages.data import PromptRecord
from stages.policy.tokenizer import TextCodec
from stages.reward import ScoredGroups, overlong_penalty, score_samples
from stages.rollout.engine import FINISH_LENGTH

__all__ = ["decode_rows", "decode_completions", "score_rows", "reward_statistics"]


def decode_rows(codec: TextCodec, rows: dict[str, np.ndarray]) -> tuple[list[str], list[str]]:
    """(prompt texts, completion texts) of stored rows (prompt_ids, prompt_len, tokens, length); a
    prompt as it was asked, without the chat template's text around it (TextCodec.decode_prompt)."""
    n = len(rows["length"])
    prompts = [codec.decode_prompt(rows["prompt_ids"][i, : rows["prompt_len"][i]].tolist()) for i in range(n)]
    return prompts, decode_completions(codec, rows)


def decode_completions(codec: TextCodec, rows: dict[str, np.ndarray]) -> list[str]:
    """The completion texts of stored rows (tokens, length)."""
    return [codec.decode(rows["tokens"][i, : rows["length"][i]].tolist()) for i in range(len(rows["length"]))]


def score_rows(codec: TextCodec, rows: dict[str, np.ndarray], records: Sequence[PromptRecord], group_size: int,
               reward: RewardConfig) -> ScoredGroups:
    """Rewards of stored rows (tokens, length; whole groups; ``records`` are their prompts, one per
    group): the completions are decoded, the prompt text and the record's fields (``answer`` ...) come from the
    record, so a reward judges the prompt as written, not its chat-templated tokens. With
    reward.overlong_buffer, DAPO's soft overlong penalty is added to each scored sample's reward."""
    completions = decode_completions(codec, rows)
    if len(completions) != len(records) * group_size:
        raise ValueError(f"{len(completions)} rows are not {len(records)} groups of {group_size}")
    prompts = [r.prompt for r in records for _ in range(group_size)]
    fields = [r.reward_kwargs() for r in records for _ in range(group_size)]
    scored = score_samples(prompts, completions, list(reward.functions), reward.timeout_s, fields=fields,
                           memory_limit_bytes=reward.memory_limit_bytes)
    if reward.overlong_buffer == 0:
        return scored
    penalty = overlong_penalty(rows["length"], rows["tokens"].shape[1], reward.overlong_buffer, reward.overlong_penalty)
    return dataclasses.replace(scored, reward=np.where(scored.failed, scored.reward, scored.reward + penalty))


def reward_statistics(reward: np.ndarray, length: np.ndarray, group_size: int,
                      failed: Optional[np.ndarray] = None, finish_reason: Optional[np.ndarray] = None
                      ) -> dict[str, float]:
    """The step's reward metrics. reward, length, failed, finish_reason: [num_samples], G rows per
    group contiguous; truncated_fraction is the share of completions cut at max_new_tokens.

    Means and reward_std (population deviation, ddof=0) are over the samples whose reward was
    scored; a failed sample (stages/reward) is counted, not averaged. A zero-variance group (all its
    scored rewards equal) has zero advantage and gives no learning signal."""
    if len(reward) % group_size:
        raise ValueError(f"{len(reward)} rewards do not form whole groups of {group_size}")
    ok = np.ones(len(reward), bool) if failed is None else ~np.asarray(failed, bool)
    trained = trained_samples(ok, group_size).reshape(-1, group_size)  # [num_groups, G]
    grouped = reward.reshape(-1, group_size)
    spread = np.where(trained, grouped, -np.inf).max(axis=1) - np.where(trained, grouped, np.inf).min(axis=1)
    scored = reward[ok] if ok.any() else np.zeros(1, np.float32)
    return {"reward_mean": float(scored.mean()), "reward_std": float(scored.std()),
            "reward_failed": float((~ok).sum()),
            "untrained_groups": float((~trained.any(axis=1)).sum()),
            "zero_variance_groups": float((trained.any(axis=1) & (spread == 0)).sum()),
            "completion_length_mean": float(length.mean()),
            **({} if finish_reason is None else
               {"truncated_fraction": float((np.asarray(finish_reason) == FINISH_LENGTH).mean())})}
