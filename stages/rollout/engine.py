"""The torch generation engine: batched sampling with a prefix-shared KV cache.

Each prompt is prefilled once; its G samples decode together, reading the shared prefix KV.
Sampling log-probs are taken from the temperature-scaled distribution before top-p truncation,
the same distribution the training loss evaluates (``logits / temperature``).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
import torch

from stages.policy.model import DecoderStage
from stages.rollout.kv_cache import PrefixSharedKVCache

__all__ = ["SamplingParams", "RolloutBatch", "FINISH_STOP", "FINISH_LENGTH", "generate"]

FINISH_STOP, FINISH_LENGTH = 0, 1


@dataclass(frozen=True)
class SamplingParams:
    group_size: int
    max_new_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    stop_ids: tuple[int, ...] = ()
    pad_id: int = 0


@dataclass
class RolloutBatch:
    """One row per completion, the G rows of a prompt contiguous."""

    prompt_ids: np.ndarray  # [P*G, prompt_width] int32, left-aligned, pad_id after prompt_len
    prompt_len: np.ndarray  # [P*G] int32
    tokens: np.ndarray  # [P*G, max_new_tokens] int32, pad_id after length
    length: np.ndarray  # [P*G] int32, generated tokens including the stop token
    behav_logp: np.ndarray  # [P*G, max_new_tokens] float32, 0 after length
    finish_reason: np.ndarray  # [P*G] int8, FINISH_STOP or FINISH_LENGTH
    kv_cache_bytes: int
    seconds: float

    @property
    def tokens_per_s(self) -> float:
        return float(self.length.sum()) / max(self.seconds, 1e-9)


def _sample(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator):
    """logits: [N, V] -> (token [N], its log-prob under softmax(logits / T) [N])."""
    logp = torch.log_softmax(logits.float() / params.temperature, dim=-1)
    probs = logp.exp()
    if params.top_p < 1.0:
        sorted_p, order = probs.sort(dim=-1, descending=True)
        keep = sorted_p.cumsum(-1) - sorted_p < params.top_p  # always keeps the top token
        sorted_p = sorted_p * keep
        probs = torch.zeros_like(probs).scatter(-1, order, sorted_p)
    token = torch.multinomial(probs, 1, generator=generator).squeeze(-1)
    return token, logp.gather(-1, token[:, None]).squeeze(-1)


@torch.no_grad()
def generate(model: DecoderStage, prompts: list[list[int]], params: SamplingParams,
             generator: torch.Generator) -> RolloutBatch:
    """Sample ``params.group_size`` completions for each tokenised prompt."""
    if not (model.is_first and model.is_last):
        raise ValueError("generate needs the whole model (one stage holding every layer)")
    start = time.perf_counter()
    P, G, N = len(prompts), params.group_size, params.max_new_tokens
    width = max(len(p) for p in prompts)
    ids = torch.full((P, width), params.pad_id, dtype=torch.long)
    mask = torch.zeros((P, width), dtype=torch.bool)
    for i, p in enumerate(prompts):  # left padding, so every prompt ends at the same column
        ids[i, width - len(p):] = torch.tensor(p)
        mask[i, width - len(p):] = True
    positions = (mask.long().cumsum(-1) - 1).clamp(min=0)
    cfg = model.cfg
    cache = PrefixSharedKVCache(cfg.num_hidden_layers, P, G, width, N, cfg.num_key_value_heads,
                                cfg.head_dim, mask, dtype=next(model.parameters()).dtype)
    logits = model(ids, positions, cache)[:, -1]  # (P, V)
    cache.advance()
    logits = logits.repeat_interleave(G, dim=0)  # (P*G, V): the G samples share the prefill
    next_pos = positions[:, -1].repeat_interleave(G) + 1  # (P*G,)

    tokens = torch.full((P * G, N), params.pad_id, dtype=torch.long)
    logps = torch.zeros((P * G, N), dtype=torch.float32)
    done = torch.zeros(P * G, dtype=torch.bool)
    length = torch.zeros(P * G, dtype=torch.long)
    stop = torch.tensor(params.stop_ids, dtype=torch.long)
    for n in range(N):
        tok, lp = _sample(logits, params, generator)
        tok = torch.where(done, params.pad_id, tok)
        tokens[:, n] = tok
        logps[:, n] = torch.where(done, 0.0, lp)
        length += (~done).long()
        done = done | torch.isin(tok, stop)
        if bool(done.all()) or n == N - 1:
            break
        logits = model(tok[:, None], (next_pos + n)[:, None], cache)[:, -1]
        cache.advance()

    prompt_ids = torch.full((P, width), params.pad_id, dtype=torch.long)
    for i, p in enumerate(prompts):
        prompt_ids[i, : len(p)] = torch.tensor(p)
    prompt_len = torch.tensor([len(p) for p in prompts]).repeat_interleave(G)
    return RolloutBatch(
        prompt_ids=prompt_ids.repeat_interleave(G, dim=0).numpy().astype(np.int32),
        prompt_len=prompt_len.numpy().astype(np.int32),
        tokens=tokens.numpy().astype(np.int32),
        length=length.numpy().astype(np.int32),
        behav_logp=logps.numpy(),
        finish_reason=np.where(done.numpy(), FINISH_STOP, FINISH_LENGTH).astype(np.int8),
        kv_cache_bytes=cache.allocated_bytes,
        seconds=time.perf_counter() - start,
    )
