"""Build the global batch of a step: fixed-shape input ids and the packed per-token target.

Sequence of sample i: prompt[:prompt_len] + tokens[:length], right-padded to
prompt_width + max_new_tokens (a fixed shape, so the pipeline never sees a new one). Position t
predicts token t + 1; completion token j sits at position prompt_len + j, so the loss covers
positions [prompt_len - 1, prompt_len - 1 + length).

The weight channel carries the aggregation's denominator over the *whole* global batch:
- token-mean:              w = 1 / (completion tokens in the batch)
- seq-mean-token-mean:     w = 1 / (length_i * samples in the batch)
- seq-mean-token-sum-norm: w = 1 / (max_new_tokens * samples in the batch)   (Dr. GRPO)
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from stages.train.loss import TARGET_FIELDS

__all__ = ["GlobalBatch", "build_global_batch", "aggregation_weights"]


@dataclass(frozen=True)
class GlobalBatch:
    input_ids: torch.Tensor  # [N, T] long
    target: torch.Tensor  # [N, T, len(TARGET_FIELDS)] float32
    num_tokens: int

    @property
    def num_samples(self) -> int:
        return int(self.input_ids.shape[0])


def aggregation_weights(length: np.ndarray, max_new_tokens: int, mode: str) -> np.ndarray:
    """Per-sample token weight w_i ([N] float64) for an aggregation mode."""
    length = length.astype(np.float64)
    n_samples = len(length)
    if mode == "token-mean":
        return np.full(n_samples, 1.0 / max(length.sum(), 1.0))
    if mode == "seq-mean-token-mean":
        return np.where(length > 0, 1.0 / (np.maximum(length, 1.0) * n_samples), 0.0)
    if mode == "seq-mean-token-sum-norm":
        return np.full(n_samples, 1.0 / (max_new_tokens * n_samples))
    raise ValueError(f"unknown loss aggregation {mode!r}")


def build_global_batch(arrays: dict[str, np.ndarray], mode: str, pad_id: int) -> GlobalBatch:
    """arrays: prompt_ids [N, Pw], prompt_len [N], tokens [N, Gw], length [N], behav_logp [N, Gw],
    ref_logp [N, Gw], advantage [N] (as stored in the rollout store)."""
    prompt_ids, prompt_len = arrays["prompt_ids"], arrays["prompt_len"]
    tokens, length = arrays["tokens"], arrays["length"]
    N, Pw = prompt_ids.shape
    Gw = tokens.shape[1]
    T = Pw + Gw
    ids = np.full((N, T), pad_id, dtype=np.int64)
    target = np.zeros((N, T, len(TARGET_FIELDS)), dtype=np.float32)
    weights = aggregation_weights(length, Gw, mode)
    for i in range(N):
        p, n = int(prompt_len[i]), int(length[i])
        ids[i, :p] = prompt_ids[i, :p]
        ids[i, p:p + n] = tokens[i, :n]
        pos = slice(p - 1, p - 1 + n)  # positions whose next token is a completion token
        target[i, pos, 0] = tokens[i, :n]
        target[i, pos, 1] = 1.0
        target[i, pos, 2] = arrays["advantage"][i]
        target[i, pos, 3] = arrays["behav_logp"][i, :n]
        target[i, pos, 4] = arrays["ref_logp"][i, :n]
        target[i, pos, 5] = weights[i]
    return GlobalBatch(torch.from_numpy(ids), torch.from_numpy(target), int(length.sum()))
