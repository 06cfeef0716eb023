"""Sampling: the truncated distribution a token is drawn from, and counter-based uniforms.

Distribution. ``truncated_logprobs`` is log softmax(logits / T), restricted to the top-k tokens
(``top_k > 0``; tokens tied with the k-th are kept) and then to the top-p nucleus of that
renormalised distribution (the smallest prefix, by descending probability, whose mass reaches
top_p; the top token is always kept), renormalised again. A token is drawn from exactly this
distribution and the behaviour log-prob recorded is its log-prob under it. With top_k = 0 and
top_p = 1 it is log softmax(logits / T), the distribution the training loss evaluates; with
truncation the two differ on the kept tokens by the log of the kept mass.

Randomness. A token's uniform depends only on (seed, prompt index, sample index, token index,
stream): a splitmix64 hash (Steele et al. 2014) of those integers, so a sample's tokens do not
depend on which other sequences share its batch, and one seed reproduces a rollout bit for bit.
Sampling is by inversion: the first token whose cumulative probability exceeds u.
"""

from __future__ import annotations

import numpy as np
import torch

__all__ = ["counter_uniforms", "sample_from", "truncated_logprobs"]

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)  # splitmix64 increment (2^64 / golden ratio)
_MUL1, _MUL2 = np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB)  # splitmix64 finaliser
_MANTISSA = 2.0 ** -53  # 53 random bits -> a float64 in [0, 1)


def _mix(x: np.ndarray) -> np.ndarray:
    x = (x ^ (x >> np.uint64(30))) * _MUL1
    x = (x ^ (x >> np.uint64(27))) * _MUL2
    return x ^ (x >> np.uint64(31))


def counter_uniforms(seed: int, prompt: np.ndarray, sample: np.ndarray, token: np.ndarray,
                     stream: int = 0) -> torch.Tensor:
    """One U[0, 1) float64 per row, a pure function of (seed, prompt, sample, token, stream)."""
    with np.errstate(over="ignore"):  # uint64 arithmetic wraps by design
        h = _mix(np.full(len(prompt), seed, dtype=np.uint64) + _GOLDEN)
        for key in (prompt, sample, token, np.full(len(prompt), stream)):
            h = _mix(h ^ (np.asarray(key, dtype=np.uint64) + _GOLDEN))
    return torch.from_numpy((h >> np.uint64(11)).astype(np.float64) * _MANTISSA)


def truncated_logprobs(logits: torch.Tensor, temperature: float, top_k: int, top_p: float) -> torch.Tensor:
    """logits [..., V] -> log-probs [..., V] of the distribution sampled from (-inf off the kept set)."""
    logp = torch.log_softmax(logits.float() / temperature, dim=-1)
    if 0 < top_k < logp.shape[-1]:
        kth = logp.topk(top_k, dim=-1).values[..., -1:]
        logp = torch.log_softmax(logp.masked_fill(logp < kth, float("-inf")), dim=-1)
    if top_p < 1.0:
        sorted_logp, order = logp.sort(dim=-1, descending=True)
        p = sorted_logp.exp()
        drop_sorted = p.cumsum(-1) - p >= top_p  # mass before a token already reaches top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        logp = torch.log_softmax(logp.masked_fill(drop, float("-inf")), dim=-1)
    return logp


def sample_from(logp: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Inversion sampling: logp [N, V], u [N] in [0, 1) -> token [N], the first with cdf > u * total."""
    cdf = logp.double().exp().cumsum(-1)
    x = (u.to(device=cdf.device, dtype=cdf.dtype) * cdf[:, -1])[:, None]  # the uniforms come from the host
    # A zero-probability token never comes first above x, as its cdf equals its predecessor's.
    return torch.searchsorted(cdf, x, right=True).squeeze(-1).clamp(max=logp.shape[-1] - 1)
