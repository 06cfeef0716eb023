"""The GRPO loss of one microbatch, an exact partial sum of the global-batch loss.

Per completion token t of sample i, with r = exp(logp - logp_old):

    l_t = -min(r * A_i, clip(r, 1 - eps_low, 1 + eps_high) * A_i) + beta * KL_k3
    KL_k3 = exp(ref - logp) - (ref - logp) - 1                   (Schulman's k3 estimator)

and the loss is sum_t w_t * l_t. The weights w_t hold the aggregation mode's denominator, a
property of the whole global batch computed before the pipeline runs (stages/train/batch.py), so
summing microbatch losses gives the full-batch loss whatever the microbatching, and nothing inside
the pipeline waits on another microbatch.

Chunked log-probs: the last stage may return its normed hidden states h [B, T, H] instead of
logits (``build_stage(..., return_hidden=True)``); :func:`grpo_chunked_loss` then takes the
completion tokens only (mask = 1) and works through them in chunks of at most ``chunk_tokens``:
the forward pass keeps only the loss; the backward pass recomputes each chunk's logits
z = h_c W^T / T_s [c, V] and applies the log-softmax gradient in closed form,

    d loss / d z_v = g_t * (1[v = next_t] - softmax(z)_v),   g_t = d loss / d logp_t,

    grad h_c = (d loss / d z) W / T_s,      grad W += (d loss / d z)^T h_c / T_s   (in place),

so neither the fp32 [tokens x vocab] logits nor one [vocab x hidden] weight gradient per chunk
ever exist: at most a couple of [chunk_tokens x vocab] blocks and one weight-gradient buffer.
(torch.utils.checkpoint per chunk would keep the logits bounded too, but autograd then sums a
fresh [V, H] weight gradient per chunk, which for a 150k vocabulary is as large as the logits.)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch
from torch import nn

__all__ = ["LossConfig", "TARGET_FIELDS", "grpo_token_terms", "grpo_microbatch_loss", "LossStats",
           "token_logp", "grpo_chunked_loss", "chunked_token_logp", "make_chunked_loss"]

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


def _chunk_logp(h: torch.Tensor, weight: torch.Tensor, next_ids: torch.Tensor, temperature: float):
    """(z [c, V] fp32 = h W^T / T_s, logsumexp(z) [c], logp [c]) of one chunk."""
    z = (h @ weight.t()).float().div_(temperature)  # (c, V): the only vocab-sized tensor of a chunk
    lse = torch.logsumexp(z, dim=-1)
    return z, lse, z.gather(-1, next_ids[:, None]).squeeze(-1) - lse


class _ChunkedGRPOLoss(torch.autograd.Function):
    """sum_t w_t l_t over completion tokens, chunk by chunk (module docstring).
    h: [n, H]; weight: [V, H]; target: [n, F] -> (loss, kl_sum, clipped_sum) scalars."""

    @staticmethod
    def forward(ctx, h, weight, target, cfg: LossConfig, chunk_tokens: int):
        loss, kl, clipped = (torch.zeros((), dtype=torch.float32, device=h.device) for _ in range(3))
        for h_c, t_c in zip(h.split(chunk_tokens), target.split(chunk_tokens)):
            _, _, logp = _chunk_logp(h_c, weight, t_c[:, _NEXT].long(), cfg.temperature)
            per_token, kl_c, clipped_c = grpo_token_terms(logp, t_c, cfg)
            loss += (per_token * t_c[:, _W]).sum()
            kl += kl_c.sum()
            clipped += clipped_c.sum()
        ctx.save_for_backward(h, weight, target)
        ctx.cfg, ctx.chunk_tokens = cfg, chunk_tokens
        ctx.mark_non_differentiable(kl, clipped)
        return loss, kl, clipped

    @staticmethod
    def backward(ctx, grad_loss, _grad_kl, _grad_clipped):
        h, weight, target = ctx.saved_tensors
        cfg, c = ctx.cfg, ctx.chunk_tokens
        grad_h = torch.empty_like(h) if ctx.needs_input_grad[0] else None
        grad_w = torch.zeros_like(weight) if ctx.needs_input_grad[1] else None
        for start in range(0, h.shape[0], c):
            h_c, t_c = h[start:start + c], target[start:start + c]
            next_ids = t_c[:, _NEXT].long()
            z, lse, logp = _chunk_logp(h_c, weight, next_ids, cfg.temperature)
            with torch.enable_grad():  # g_t = d loss / d logp_t: per-token terms, [c] only
                lp = logp.detach().requires_grad_()
                per_token, _, _ = grpo_token_terms(lp, t_c, cfg)
                (g,) = torch.autograd.grad((per_token * t_c[:, _W]).sum(), lp)
            g = g * grad_loss
            dz = z.sub_(lse[:, None]).exp_().mul_(-g[:, None])  # -g_t softmax(z), in z's buffer
            dz.scatter_add_(-1, next_ids[:, None], g[:, None])  # + g_t at the next token
            dz = dz.div_(cfg.temperature).to(h.dtype)  # d loss / d logits
            if grad_h is not None:
                grad_h[start:start + c] = dz @ weight
            if grad_w is not None:
                grad_w.addmm_(dz.t(), h_c)
        return grad_h, grad_w, None, None, None


def grpo_chunked_loss(hidden: torch.Tensor, target: torch.Tensor, lm_head: nn.Linear, cfg: LossConfig,
                      chunk_tokens: int):
    """(loss scalar, LossStats) of one microbatch from the last stage's normed hidden states, equal to
    ``grpo_microbatch_loss(lm_head(hidden), target, cfg)`` while holding at most a few
    [chunk_tokens, V] blocks at a time, forward and backward. hidden: [B, T, H]; target: [B, T, F].

    Only completion tokens (mask = 1) are projected: the loss of every other position is 0.
    """
    if chunk_tokens < 1:
        raise ValueError(f"chunk_tokens={chunk_tokens} must be >= 1")
    if lm_head.bias is not None:
        raise ValueError("grpo_chunked_loss takes a bias-free lm_head (Llama / Qwen2 heads have none)")
    H = hidden.shape[-1]
    flat_t = target.reshape(-1, target.shape[-1])  # (B*T, F)
    idx = flat_t[:, _MASK].nonzero().squeeze(-1)  # (n,) completion-token positions
    # An empty selection still yields a loss connected to ``hidden`` (zero gradient): the pipeline
    # runs backward on every microbatch, empty ones too.
    h, t = hidden.reshape(-1, H)[idx], flat_t[idx]  # (n, H), (n, F)
    loss, kl, clipped = _ChunkedGRPOLoss.apply(h, lm_head.weight, t, cfg, chunk_tokens)
    stats = LossStats(float(loss.detach()), float(kl), float(clipped), float(t[:, _MASK].sum()))
    return loss, stats


@torch.no_grad()
def chunked_token_logp(hidden: torch.Tensor, next_ids: torch.Tensor, lm_head: nn.Linear, temperature: float,
                       chunk_tokens: int) -> torch.Tensor:
    """token_logp(lm_head(hidden), next_ids) computed chunk by chunk, forward only (the reference
    pass). hidden: [B, T, H]; next_ids: [B, T] -> [B, T]."""
    B, T, H = hidden.shape
    flat, ids = hidden.reshape(-1, H), next_ids.reshape(-1)
    out = torch.cat([token_logp(lm_head(h_c), i_c, temperature)
                     for h_c, i_c in zip(flat.split(chunk_tokens), ids.split(chunk_tokens))])
    return out.view(B, T)


def make_chunked_loss(lm_head: nn.Linear, cfg: LossConfig, chunk_tokens: int,
                      on_stats: Optional[Callable[[LossStats], None]] = None
                      ) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """A pipeline ``loss_fn(hidden, target) -> loss`` for a last stage built with
    ``return_hidden=True`` whose head is ``lm_head``; each microbatch's LossStats go to on_stats."""

    def loss_fn(hidden: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        loss, stats = grpo_chunked_loss(hidden, target, lm_head, cfg, chunk_tokens)
        if on_stats is not None:
            on_stats(stats)
        return loss

    return loss_fn
