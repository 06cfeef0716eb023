"""The per-stage work of an iteration that is not a stage package of its own: the tiny base
policy's model config and warm-up, decoding rows for scoring, reward statistics, and the
training rank's setup. Typed inputs in, values out; no IO (flows/tasks.py loads and saves through
storage/ around these calls).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Optional, Sequence

import numpy as np
import torch

from stages.advantage import trained_samples
from stages.config import ModelConfig, RewardConfig, TrainConfig, WarmupConfig, effective_off_policy
from stages.data import PromptRecord
from stages.policy import DecoderConfig
from stages.policy.tokenizer import TextCodec
from stages.rollout.engine import FINISH_LENGTH
from stages.reward import ScoredGroups, overlong_penalty, score_samples
from stages.tasks.addition import make_tokenizer_json, warmup_pairs
from stages.train.auto import auto_logprob_chunk_tokens, auto_lr
from stages.train.engine import InjectedFault, TrainSetup
from stages.train.loss import LossConfig
from stages.warmup import supervised_warmup

__all__ = ["TinyPolicy", "tiny_max_positions", "tiny_decoder_config", "tiny_base_policy", "decode_rows",
           "score_rows", "reward_statistics", "train_setup"]

_WARMUP_PAIRS = 4096  # supervised examples the warm-up samples its batches from


def tiny_max_positions(num_digits: int, max_new_tokens: int) -> int:
    """The longest sequence the tiny model sees: the widest prompt ("<bos>a+b=") and the longer of
    a rollout completion (max_new_tokens) and a warm-up answer (num_digits + 1 digits and EOS)."""
    prompt_width = 1 + 2 * num_digits + 2
    return prompt_width + max(max_new_tokens, num_digits + 2)


def tiny_decoder_config(model: ModelConfig, codec: TextCodec, max_positions: int) -> DecoderConfig:
    """The decoder config of the task's tiny model: the model section's shape, the tokenizer's
    vocabulary and special ids."""
    shape = model.shape(codec.vocab_size)
    return DecoderConfig(
        **{f.name: getattr(shape, f.name) for f in dataclasses.fields(shape)}, rope_theta=model.rope_theta,
        max_position_embeddings=max_positions, bos_token_id=codec.bos_id, eos_token_id=codec.eos_id,
        pad_token_id=codec.pad_id)


@dataclass(frozen=True)
class TinyPolicy:
    """Policy v0 made by the warm-up: what storage/policies.py saves as an HF folder."""

    hf_config: dict  # config.json
    tokenizer_json: str
    tensors: dict[str, torch.Tensor]  # HF names


def tiny_base_policy(model: ModelConfig, warmup: WarmupConfig, num_digits: int, max_new_tokens: int,
                     seed: int) -> TinyPolicy:
    """The task's tiny model after ``warmup.steps`` supervised steps (deterministic in its inputs)."""
    tokenizer_json = make_tokenizer_json()
    codec = TextCodec.from_json(tokenizer_json)
    model_cfg = tiny_decoder_config(model, codec, tiny_max_positions(num_digits, max_new_tokens))
    pairs = warmup_pairs(seed, _WARMUP_PAIRS, num_digits)
    tensors = supervised_warmup(model_cfg, codec, pairs, warmup.steps, warmup.batch_size, warmup.lr, seed)
    return TinyPolicy(model_cfg.to_hf(), tokenizer_json, tensors)


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


def train_setup(train: TrainConfig, model_cfg: DecoderConfig, num_microbatches: int, temperature: float,
                faults: tuple[InjectedFault, ...] = (), max_staleness: int = 0,
                reference_parallel: Optional[str] = None,
                logprob_chunk_tokens: Optional[int] = None,
                layer_split: Optional[tuple[int, ...]] = None, engine: str = "native",
                lr: Optional[float] = None) -> TrainSetup:
    """A training rank's setup: the train section, the model, the per-pipeline microbatch count
    and the rollout temperature (the loss scores log-probs at the sampling temperature);
    max_staleness and the rollout engine pick the off-policy default (stages/config.py
    effective_off_policy);
    reference_parallel: train.reference_parallel resolved (GRPOConfig.reference_parallel; None:
    the section's own value, or pipeline for auto); logprob_chunk_tokens: train.logprob_chunk_tokens
    resolved (GRPOConfig.logprob_chunk_tokens; None: the section's own value, auto resolved for
    model_cfg's vocabulary by the same rule, stages/train/auto.py); layer_split: train.layer_split
    resolved (GRPOConfig.layer_split; None: the section's own list, or the even split for auto);
    lr: train.lr resolved (GRPOConfig.lr; None: the section's own number, or for auto the built-in
    model's rate; each training step sets its own rate after this one, flows/tasks.py)."""
    t = train
    chunk = t.logprob_chunk_tokens
    if chunk == "auto":
        chunk = auto_logprob_chunk_tokens(model_cfg.vocab_size)
    return TrainSetup(
        model=model_cfg, pipeline_parallel_size=t.pipeline_model_parallel_size,
        num_microbatches=num_microbatches, schedule=t.schedule,
        virtual_stages=t.virtual_pipeline_model_parallel_size, data_parallel_size=t.data_parallel_size,
        tensor_parallel_size=t.tensor_model_parallel_size,
        lr=lr if lr is not None else (t.lr if t.lr != "auto" else auto_lr(pretrained=False)), weight_decay=t.weight_decay,
        max_grad_norm=t.max_grad_norm,
        loss=LossConfig(t.clip_eps_low, t.clip_eps_high, t.kl_beta, temperature,
                        effective_off_policy(t, max_staleness, engine), ratio_level=t.policy_ratio),
        logprob_chunk_tokens=logprob_chunk_tokens or chunk, timeout_s=t.timeout_s, faults=faults,
        reference_parallel=reference_parallel or (t.reference_parallel if t.reference_parallel != "auto"
                                                  else "pipeline"),
        reference=t.uses_reference, device=t.device, dtype=t.dtype,
        layer_split=layer_split or (tuple(t.layer_split) if t.layer_split != "auto" else None))
