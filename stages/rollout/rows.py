"""A rollout task's work: sample G completions of each tokenised prompt, and lay them out as the
rows of the step's store.

Rows of prompt p (0-based within the step) are rows [p * G, (p + 1) * G) of the step, and carry
group id ``step * prompts_per_step + p``, so group ids are unique across a run. Sampling is seeded
by (run seed, step, first prompt): a rerun of a step's range regenerates the same rows.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from stages.config import RolloutConfig
from stages.policy.tokenizer import TextCodec
from stages.rollout.contract import RolloutEngine
from stages.rollout.engine import FINISH_STOP, RolloutBatch, SamplingParams

__all__ = ["RolloutRows", "ROUND_GROUP_STRIDE", "rollout_seed", "first_group_id", "sampling_params",
           "cut_at_stop_strings", "rollout_rows", "generate_rows"]

# Multipliers of the seed mix: primes, so (seed, step, prompt_start) triples that differ give
# different seeds for any realistic run (steps < 1_000_003 / 1_009, prompts per step < 1_009).
_SEED_MUL, _STEP_MUL = 1_000_003, 1_009


@dataclass(frozen=True)
class RolloutRows:
    """Rows [row_start, row_start + num_rows) of a step, by store array name, and what the
    generation measured."""

    row_start: int
    arrays: dict[str, np.ndarray]  # name -> [num_rows, ...], the names of storage/rollouts.ARRAYS
    metrics: dict[str, float]

    @property
    def num_rows(self) -> int:
        return len(self.arrays["length"])


# Group ids of a step's extra rounds (rollout.dynamic_sampling) sit above round 0's: round r adds r
# times this, so ids stay unique across a run of fewer than 2**40 / prompts_per_step steps.
ROUND_GROUP_STRIDE = 1 << 40


def rollout_seed(seed: int, step: int, prompt_start: int, round: int = 0) -> int:
    """The sampling generator's seed for prompts starting at ``prompt_start`` of step ``step``;
    ``round`` >= 1: of an extra round (rollout.dynamic_sampling), a seed of its own."""
    if round:
        return int(np.random.SeedSequence([seed, step, prompt_start, round]).generate_state(1, np.uint64)[0] >> 1)
    return seed * _SEED_MUL + step * _STEP_MUL + prompt_start


def first_group_id(step: int, prompts_per_step: int, prompt_start: int, round: int = 0) -> int:
    """Run-wide group id of prompt ``prompt_start`` of step ``step`` (of its extra round ``round``)."""
    return step * prompts_per_step + prompt_start + round * ROUND_GROUP_STRIDE


def sampling_params(cfg: RolloutConfig, codec: TextCodec) -> SamplingParams:
    return SamplingParams(cfg.group_size, cfg.max_new_tokens, cfg.temperature, cfg.top_p, tuple(codec.eos_ids),
                          codec.pad_id, top_k=cfg.top_k)


def cut_at_stop_strings(batch: RolloutBatch, codec: TextCodec, stop: Sequence[str]) -> RolloutBatch:
    """Each completion ended at its first token whose text completes one of ``stop``
    (rollout.stop): that token is kept, as a stop token is, the rest becomes padding (behav_logp 0)
    and the finish reason is stop. Exact: a sample's tokens up to there are what a sampler stopping
    at the string would have drawn, since no token depends on the ones after it; only the compute
    spent past the string is wasted."""
    if not stop:
        return batch
    tokens, logp = batch.tokens.copy(), batch.behav_logp.copy()
    length, finish = batch.length.copy(), batch.finish_reason.copy()
    for row in range(len(length)):
        ids = tokens[row, : length[row]].tolist()
        if not any(s in codec.decode(ids) for s in stop):
            continue
        end = next(k for k in range(1, len(ids) + 1) if any(s in codec.decode(ids[:k]) for s in stop))
        tokens[row, end:], logp[row, end:] = codec.pad_id, 0.0
        length[row], finish[row] = end, FINISH_STOP
    return dataclasses.replace(batch, tokens=tokens, behav_logp=logp, length=length, finish_reason=finish)


def rollout_rows(batch: RolloutBatch, prompt_width: int, pad_id: int, first_group: int, group_size: int,
                 policy_version: int, row_start: int = 0) -> RolloutRows:
    """The store rows of a generated batch: prompts right-padded to the step's ``prompt_width``,
    a group id per row (G rows per prompt) and the generating policy version."""
    rows = len(batch.length)
    if batch.prompt_ids.shape[1] > prompt_width:
        raise ValueError(f"prompts of {batch.prompt_ids.shape[1]} tokens do not fit the step's "
                         f"prompt width {prompt_width}")
    prompt_ids = np.full((rows, prompt_width), pad_id, dtype=np.int32)  # [P*G, prompt_width]
    prompt_ids[:, : batch.prompt_ids.shape[1]] = batch.prompt_ids
    group_id = first_group + np.arange(rows, dtype=np.int64) // group_size  # [P*G]
    arrays = {
        "prompt_ids": prompt_ids, "prompt_len": batch.prompt_len, "tokens": batch.tokens, "length": batch.length,
        "behav_logp": batch.behav_logp, "finish_reason": batch.finish_reason, "group_id": group_id,
        "policy_version": np.full(rows, policy_version, dtype=np.int32),
    }
    metrics = {"rollout_tokens": float(batch.length.sum()), "rollout_seconds": batch.seconds,
               "rollout_tokens_per_s": batch.tokens_per_s, "kv_cache_bytes": float(batch.kv_cache_bytes)}
    return RolloutRows(row_start, arrays, metrics)


def generate_rows(engine: RolloutEngine, codec: TextCodec, prompt_ids: Sequence[Sequence[int]], cfg: RolloutConfig,
                  *, seed: int, step: int, prompt_start: int, prompts_per_step: int, prompt_width: int,
                  policy_version: int, round: int = 0) -> RolloutRows:
    """Sample ``cfg.group_size`` completions of each tokenised prompt (prompts ``prompt_start``
    onwards of the step, as the prompt source gives them: template and BOS included; ``round``
    >= 1: of the step's extra round) on ``engine``, which must hold ``policy_version``, and return
    their rows. The engine's own metrics (speculative_acceptance, ...) join the rows' metrics."""
    batch = engine.generate(policy_version, prompt_ids, sampling_params(cfg, codec),
                            rollout_seed(seed, step, prompt_start, round))
    batch = cut_at_stop_strings(batch, codec, cfg.stop)
    rows = rollout_rows(batch, prompt_width, codec.pad_id, first_group_id(step, prompts_per_step, prompt_start, round),
                        cfg.group_size, batch.policy_version, row_start=prompt_start * cfg.group_size)
    rows.metrics.update(batch.metrics)
    return rows
