"""The GRPO loss of one microbatch, an exact partial sum of the global-batch loss.

Per completion token t of sample i, with r = exp(logp - logp_old):

    l_t = -min(r * A_i, clip(r, 1 - eps_low, 1 + eps_high) * A_i) + beta * KL_k3
    KL_k3 = exp(ref - logp) - (ref - logp) - 1                   (Schulman's k3 estimator)

and the loss is sum_t w_t * l_t. The weights w_t hold the aggregation mode's denominator, a
property of the whole global batch computed before the pipeline runs (stages/train/batch.py), so
summing microbatch losses gives the full-batch loss whatever the microbatching, and nothing inside
the pipeline waits on another microbatch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["LossConfig", "TARGET_FIELDS", "grpo_token_terms", "grpo_microbatch_loss", "LossStats"]

# Channels of the packed per-token target tensor [B, T, len(TARGET_FIELDS)]: the pipeline API
# hands the last stage one target tensor, so everything the loss needs travels in it.
TARGET_FIELDS = ("next_id", "mask", "advantage", "old_logp", "ref_logp", "weight")
_NEXT, _MASK, _ADV, _OLD, _REF, _W = range(len(TARGET_FIELDS))


@dataclass(frozen=True)
class LossConfig:
    clip_eps_low: float = 0.2
    clip_eps_high: float = 0.2
    kl_beta: float = 0.0
    temperature: float = 1.0


def token_logp(logits: torch.Tensor, next_ids: torch.Tensor, temperature: float) -> torch.Tensor:
    """log softmax(logits / T) at next_ids. logits: [B, T, V]; next_ids: [B, T] -> [B, T]."""
    logp = torch.log_softmax(logits.float() / temperature, dim=-1)
    return logp.gather(-1, next_ids.long().unsqueeze(-1)).squeeze(-1)


def grpo_token_terms(logp: torch.Tensor, target: torch.Tensor, cfg: LossConfig):
    """Per-token loss, KL and clip indicator, each [B, T] (zero where mask is 0)."""
    mask, adv = target[..., _MASK], target[..., _ADV]
    old, ref = target[..., _OLD], target[..., _REF]
    log_ratio = (logp - old) * mask
    ratio = torch.exp(log_ratio)
    clipped_ratio = ratio.clamp(1.0 - cfg.clip_eps_low, 1.0 + cfg.clip_eps_high)
    surrogate = -torch.minimum(ratio * adv, clipped_ratio * adv)
    delta = (ref - logp) * mask
    kl = torch.exp(delta) - delta - 1.0
    per_token = (surrogate + cfg.kl_beta * kl) * mask
    clipped = ((ratio * adv) > (clipped_ratio * adv)).float() * mask
    return per_token, kl * mask, clipped


@dataclass
class LossStats:
    """Sums over the microbatches of one step; turned into metrics on the last stage."""

    loss: float = 0.0
    kl_sum: float = 0.0
    clipped_sum: float = 0.0
    tokens: float = 0.0

    def add(self, other: "LossStats") -> None:
        self.loss += other.loss
        self.kl_sum += other.kl_sum
        self.clipped_sum += other.clipped_sum
        self.tokens += other.tokens

    def metrics(self) -> dict[str, float]:
        n = max(self.tokens, 1.0)
        return {"loss": self.loss, "kl": self.kl_sum / n, "clip_fraction": self.clipped_sum / n}


def grpo_microbatch_loss(logits: torch.Tensor, target: torch.Tensor, cfg: LossConfig):
    """(loss scalar, LossStats) of one microbatch. logits: [B, T, V]; target: [B, T, F]."""
    logp = token_logp(logits, target[..., _NEXT], cfg.temperature)
    per_token, kl, clipped = grpo_token_terms(logp, target, cfg)
    loss = (per_token * target[..., _W]).sum()
    with torch.no_grad():
        stats = LossStats(float(loss), float(kl.sum()), float(clipped.sum()), float(target[..., _MASK].sum()))
    return loss, stats
