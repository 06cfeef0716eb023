"""The addition task's base policy: the tiny model's config (the model section's shape, the
addition tokenizer's vocabulary and special ids) after its supervised warm-up (stages/warmup.py).
Typed inputs in, tensors out; storage/policies.py saves it as policy v0's HF folder.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from stages.config import ModelConfig, WarmupConfig
from stages.policy import DecoderConfig
from stages.policy.tokenizer import TextCodec
from stages.tasks.addition import make_tokenizer_json, warmup_pairs
from stages.warmup import supervised_warmup

__all__ = ["TinyPolicy", "tiny_max_positions", "tiny_decoder_config", "tiny_base_policy"]

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
