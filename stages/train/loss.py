"""The GRPO loss of one microbatch, an exact partial sum of the global-batch loss.

Per completion token t of sample i, with r = pi_theta / pi_anchor = exp(logp - logp_anchor):

    l_t = w_t * -min(r * A_i, clip(r, 1 - eps_low, 1 + eps_high) * A_i) + beta * KL_k3
    KL_k3 = exp(ref - logp) - (ref - logp) - 1                   (Schulman's k3 estimator)

On-policy (``OffPolicyConfig.decoupled`` False) the anchor is the behaviour policy and w_t = 1.
Decoupled PPO (Hilton et al. 2021, "Batch size-invariance for policy optimization"; AReaL, Fu et
al. 2025) anchors the clip on the proximal policy and corrects for the stale behaviour policy
with the importance weight w = pi_prox / pi_behav, truncated (TIS) or masked (MIS) above a cap C,
per token or per sequence (:class:`OffPolicyConfig`). With prox = behav every w is exactly 1.
Dual-clip (Ye et al. 2020, verl ``clip_ratio_c``) bounds the loss of A < 0 tokens at -c * A.

GSPO (Zheng et al. 2025, "Group Sequence Policy Optimization"; ``ratio_level="sequence"``) puts
one ratio per sequence in place of r, the geometric mean of its tokens' ratios,

    s_i = exp(mean_{t in i} (logp_t - logp_anchor_t)),     l_i = -min(s_i A_i, clip(s_i, ...) A_i)

(dual clip and importance weight as above), and gives l_i to every token of sequence i; the k3 KL
stays per token. Then sum_t W_t l_t = sum_i (sum_{t in i} W_t) l_i, the paper's mean_i l_i under
seq-mean-token-mean (sum_{t in i} W_t = 1 / N_seq). On-policy (s_i = 1, no clip) d s_i / d logp_t
= s_i / |y_i|, so token t of i gets -(sum_{t' in i} W_t') A_i / |y_i| = -W_t A_i, GRPO's gradient,
in every aggregation mode (each holds W constant over a sequence).

The loss is sum_t W_t * l_t. The weights W_t hold the aggregation mode's denominator, a
property of the whole global batch computed before the pipeline runs (stages/train/batch.py), so
summing microbatch losses gives the full-batch loss whatever the microbatching, and nothing inside
the pipeline waits on another microbatch.

Masked positions (mask = 0: prompts, padding, samples not trained on) may hold any value, inf and
nan included: every input is *selected* with torch.where before any arithmetic, never multiplied
by the mask, so neither the loss nor its gradient can pick up a non-finite value from them.

Chunked log-probs: the last stage may return its normed hidden states h [B, T, H] instead of
logits (``build_stage(..., return_hidden=True)``); :func:`grpo_chunked_loss` then takes the
completion tokens only (mask = 1) and works through them in chunks of at most ``chunk_tokens``:
the forward pass keeps only the loss; the backward pass recomputes each chunk's logits
z = h_c W^T / T_s [c, V] and applies the log-softmax gradient in closed form,

    d loss / d z_v = g_t * (1[v = next_t] - softmax(z)_v),   g_t = d loss / d logp_t,

    grad h_c = (d loss / d z) W / T_s,      grad W += (d loss / d z)^T h_c / T_s   (in place),

so neither the fp32 [tokens x vocab] logits nor one [vocab x hidden] weight gradient per chunk
ever exist: at most a couple of [chunk_tokens x vocab] blocks and one weight-gradient buffer.
Per-token ratios take g_t from the chunk's own terms. A sequence ratio makes g_t depend on the
whole sequence, which chunks may split: the forward keeps every chunk's logp ([n] floats) and
evaluates the loss over all of them at once, and the backward takes g = d loss / d logp [n] from
that vector by autograd before it recomputes the chunks' logits.
(torch.utils.checkpoint per chunk would keep the logits bounded too, but autograd then sums a
fresh [V, H] weight gradient per chunk, which for a 150k vocabulary is as large as the logits.)
"""

from __future__ import annotations

from dataclasses import astuple, dataclass, field, fields
from typing import Callable, Literal, NamedTuple, Optional

import torch
from torch import nn

from stages.config import POLICY_RATIOS
from stages.config import IS_LEVELS, IS_MODES, OffPolicyConfig

__all__ = ["LossConfig", "OffPolicyConfig", "IS_LEVELS", "IS_MODES", "TARGET_FIELDS", "ImportanceWeights", "TokenTerms",
           "importance_weights", "grpo_token_terms", "grpo_logp_loss", "grpo_microbatch_loss", "LossStats",
           "token_logp", "grpo_chunked_loss", "chunked_token_logp", "make_chunked_loss"]

# Channels of the packed per-token target tensor [B, T, len(TARGET_FIELDS)]: the pipeline API
# hands the last stage one target tensor, so everything the loss needs travels in it.
# sample_id (the sample's store index, exact in float32 below 2**24) groups tokens into sequences
# for the sequence-level importance weight.
TARGET_FIELDS = ("next_id", "mask", "advantage", "old_logp", "ref_logp", "weight", "prox_logp", "sample_id")
_NEXT, _MASK, _ADV, _OLD, _REF, _W, _PROX, _SAMPLE = range(len(TARGET_FIELDS))



@dataclass(frozen=True)
class LossConfig:
    clip_eps_low: float = 0.2
    clip_eps_high: float = 0.2
    kl_beta: float = 0.0
    temperature: float = 1.0
    off_policy: OffPolicyConfig = field(default_factory=OffPolicyConfig)
    """Importance weights, dual-clip and the KL / log-ratio clamps."""
    ratio_level: Literal["token", "sequence"] = "token"
    """token: GRPO's ratio per token. sequence: GSPO's, one per sequence (module docstring);
    the run config's ``train.policy_ratio``."""

    def __post_init__(self) -> None:
        if self.ratio_level not in POLICY_RATIOS:
            raise ValueError(f"ratio_level={self.ratio_level!r} (train.policy_ratio): use one of {POLICY_RATIOS}")


def token_logp(logits: torch.Tensor, next_ids: torch.Tensor, temperature: float) -> torch.Tensor:
    """log softmax(logits / T) at next_ids. logits: [B, T, V]; next_ids: [B, T] -> [B, T]."""
    logp = torch.log_softmax(logits.float() / temperature, dim=-1)
    return logp.gather(-1, next_ids.long().unsqueeze(-1)).squeeze(-1)


def _selected(mask: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """values where mask, else 0: a select, so a nan / inf in a masked slot never propagates."""
    return torch.where(mask, values, torch.zeros_like(values))


def _sequence_index(mask: torch.Tensor, sample_id: torch.Tensor) -> torch.Tensor:
    """[...] index (0, 1, ...) of each token's sequence; tokens of one sample share its id, and
    the masked slots share one index of their own."""
    ids = torch.where(mask, sample_id, torch.full_like(sample_id, -1.0)).long()
    return torch.unique(ids, return_inverse=True)[1]


def _sequence_mean(values: torch.Tensor, seq: torch.Tensor) -> torch.Tensor:
    """Each token's mean of values [...] over its sequence (seq from _sequence_index), [...];
    differentiable."""
    flat = seq.reshape(-1)
    sums = values.new_zeros(int(seq.max()) + 1 if seq.numel() else 0).index_add(0, flat, values.reshape(-1))
    counts = torch.zeros_like(sums).index_add_(0, flat, torch.ones_like(values).reshape(-1))
    return (sums / counts)[seq]  # every index in seq has count >= 1


class ImportanceWeights(NamedTuple):
    """Per-token importance weights w = pi_prox / pi_behav, each [...] (0 where mask is 0)."""

    weight: torch.Tensor  # what multiplies the surrogate: after the cap (TIS) or the drop (MIS)
    raw: torch.Tensor  # before the cap
    truncated: torch.Tensor  # 1 where TIS lowered w to the cap
    masked: torch.Tensor  # 1 where MIS dropped the token


@torch.no_grad()
def importance_weights(target: torch.Tensor, cfg: OffPolicyConfig) -> ImportanceWeights:
    """The importance weights of the tokens of target [..., F] (no gradient: pi_prox and pi_behav
    are fixed). Not decoupled: every weight is 1."""
    mask = target[..., _MASK] > 0
    ones, zeros = mask.float(), torch.zeros_like(target[..., _MASK])
    if not cfg.decoupled:
        return ImportanceWeights(ones, ones, zeros, zeros)
    b = cfg.log_ratio_clamp
    log_w = _selected(mask, target[..., _PROX] - target[..., _OLD]).clamp(-b, b)
    if cfg.is_level != "token":
        # Tokens of one sample share its id; sum (or average) their log-ratios per sample.
        seq = _sequence_index(mask, target[..., _SAMPLE])  # [...] -> index of the token's sequence
        sums = torch.zeros(int(seq.max()) + 1 if seq.numel() else 0, dtype=log_w.dtype, device=log_w.device)
        sums.index_add_(0, seq.reshape(-1), log_w.reshape(-1))
        if cfg.is_level == "geometric":
            counts = torch.zeros_like(sums).index_add_(0, seq.reshape(-1), ones.reshape(-1))
            sums = sums / counts.clamp(min=1.0)
        log_w = sums[seq].clamp(-b, b)
    raw = _selected(mask, torch.exp(log_w))
    over = raw > cfg.is_cap
    if cfg.is_mode == "truncate":
        return ImportanceWeights(torch.where(over, torch.full_like(raw, cfg.is_cap), raw), raw, over.float(), zeros)
    if cfg.is_mode == "mask":
        return ImportanceWeights(_selected(~over, raw), raw, zeros, over.float())
    return ImportanceWeights(raw, raw, zeros, zeros)


class TokenTerms(NamedTuple):
    """Per-token loss and diagnostics, each [...] and 0 where mask is 0."""

    loss: torch.Tensor  # l_t (before the aggregation weight)
    kl: torch.Tensor  # k3 KL(current || reference) estimate, clamped as in the loss
    behav_kl: torch.Tensor  # k3 KL(behaviour || current): exp(logp - behav) - (logp - behav) - 1
    clip_low: torch.Tensor  # 1 where the clip binds at 1 - eps_low (A < 0)
    clip_high: torch.Tensor  # 1 where the clip binds at 1 + eps_high (A > 0)
    dual_clip: torch.Tensor  # 1 where the dual-clip bound -c * A binds (A < 0)


def grpo_token_terms(logp: torch.Tensor, target: torch.Tensor, cfg: LossConfig,
                     is_weight: Optional[torch.Tensor] = None) -> TokenTerms:
    """Per-token terms of logp [...] against target [..., F]; is_weight [...] multiplies the
    surrogate (None: 1, e.g. on-policy). With ``ratio_level="sequence"`` logp must hold every
    completion token of each sequence it touches: a token's surrogate is its sequence's."""
    opc = cfg.off_policy
    mask = target[..., _MASK] > 0
    logp = _selected(mask, logp)
    adv = _selected(mask, target[..., _ADV])
    old = _selected(mask, target[..., _OLD])
    anchor = _selected(mask, target[..., _PROX]) if opc.decoupled else old
    b = opc.log_ratio_clamp
    if cfg.ratio_level == "sequence":
        # GSPO: every token takes its sequence's s_i, so the clip and the dual clip below bind per
        # sequence and the surrogate is l_i on each token (its advantage is the sequence's A_i).
        ratio = torch.exp(_sequence_mean(logp - anchor, _sequence_index(mask, target[..., _SAMPLE])).clamp(-b, b))
    else:
        ratio = torch.exp((logp - anchor).clamp(-b, b))
    clipped_ratio = ratio.clamp(1.0 - cfg.clip_eps_low, 1.0 + cfg.clip_eps_high)
    unclipped_obj, clipped_obj = ratio * adv, clipped_ratio * adv
    surrogate = -torch.minimum(unclipped_obj, clipped_obj)
    clip_binds = unclipped_obj > clipped_obj
    dual = torch.zeros_like(mask)
    if opc.dual_clip:
        bound = -opc.dual_clip_c * adv  # > 0 where A < 0
        dual = (adv < 0) & (surrogate > bound)
        surrogate = torch.where(dual, bound, surrogate)
    if is_weight is not None:
        surrogate = surrogate * is_weight
    delta = (_selected(mask, target[..., _REF]) - logp).clamp(-b, b)
    kl = torch.exp(delta) - delta - 1.0
    if opc.kl_clamp is not None:
        kl = kl.clamp(max=opc.kl_clamp)
    per_token = _selected(mask, surrogate + cfg.kl_beta * kl)
    with torch.no_grad():
        behav = (logp - old).clamp(-b, b)
        behav_kl = _selected(mask, torch.exp(behav) - behav - 1.0)
        # The PPO clip binds only on the optimistic side (r < 1 - eps with A < 0, r > 1 + eps with
        # A > 0), the dual clip only on the pessimistic side of A < 0: the three never overlap.
        clip_low = (clip_binds & (ratio < 1.0 - cfg.clip_eps_low) & mask).float()
        clip_high = (clip_binds & (ratio > 1.0 + cfg.clip_eps_high) & mask).float()
    return TokenTerms(per_token, _selected(mask, kl.detach()), behav_kl, clip_low, clip_high, (dual & mask).float())


@dataclass
class LossStats:
    """Sums over the microbatches of one step, the last field a max; turned into metrics on the
    last stage. clipped_sum counts the PPO clip (low + high), not the dual clip; a clip that binds
    on a sequence ratio (GSPO) counts every token of the sequence. The importance
    weight fields count tokens (a sequence-level weight once per token of its sequence), raw
    weights before the cap; kl_behav is the k3 estimate of KL(behaviour || current)."""

    loss: float = 0.0
    kl_sum: float = 0.0
    clipped_sum: float = 0.0
    tokens: float = 0.0
    clip_low_sum: float = 0.0
    clip_high_sum: float = 0.0
    dual_clip_sum: float = 0.0
    behav_kl_sum: float = 0.0
    is_weight_sum: float = 0.0
    is_truncated_sum: float = 0.0
    is_masked_sum: float = 0.0
    is_weight_max: float = 0.0

    @classmethod
    def of(cls, loss: float, terms_sums: torch.Tensor, isw: ImportanceWeights, mask: torch.Tensor) -> "LossStats":
        """From the loss, the summed token terms [kl, behav_kl, clip_low, clip_high, dual_clip] and
        the importance weights of one microbatch."""
        kl, behav_kl, low, high, dual = terms_sums.tolist()
        raw = isw.raw[mask > 0]
        return cls(loss, kl, low + high, float(mask.sum()), low, high, dual, behav_kl, float(raw.sum()),
                   float(isw.truncated.sum()), float(isw.masked.sum()), float(raw.max()) if raw.numel() else 0.0)

    def add(self, other: "LossStats") -> None:
        for f in fields(self)[:-1]:
            setattr(self, f.name, getattr(self, f.name) + getattr(other, f.name))
        self.is_weight_max = max(self.is_weight_max, other.is_weight_max)

    def sums(self) -> list[float]:
        """The summed fields, in order (a SUM all-reduce); is_weight_max is reduced by MAX."""
        return list(astuple(self)[:-1])

    def metrics(self) -> dict[str, float]:
        n = max(self.tokens, 1.0)
        return {"loss": self.loss, "kl": self.kl_sum / n, "clip_fraction": self.clipped_sum / n,
                "clip_fraction_low": self.clip_low_sum / n, "clip_fraction_high": self.clip_high_sum / n,
                "dual_clip_fraction": self.dual_clip_sum / n, "kl_behav": self.behav_kl_sum / n,
                "is_weight_mean": self.is_weight_sum / n, "is_weight_max": self.is_weight_max,
                "is_truncated_fraction": self.is_truncated_sum / n, "is_masked_fraction": self.is_masked_sum / n}


def _terms_sums(terms: TokenTerms) -> torch.Tensor:
    """[kl, behav_kl, clip_low, clip_high, dual_clip] sums of one microbatch or chunk."""
    return torch.stack([t.detach().sum() for t in terms[1:]])


def _with_current_proximal(target: torch.Tensor, logp: torch.Tensor, cfg: OffPolicyConfig) -> torch.Tensor:
    """target with its prox_logp channel set to ``logp`` (the current weights' log-probs, no
    gradient) when decoupled PPO takes pi_prox from the current weights (``proximal: current``)."""
    if not (cfg.decoupled and cfg.proximal == "current"):
        return target
    target = target.clone()
    target[..., _PROX] = logp.to(target.dtype)
    return target


def grpo_logp_loss(logp: torch.Tensor, target: torch.Tensor, cfg: LossConfig):
    """(loss scalar, LossStats) of one microbatch from its token log-probs. logp: [...];
    target: [..., F]."""
    target = _with_current_proximal(target, logp.detach(), cfg.off_policy)
    isw = importance_weights(target, cfg.off_policy)
    terms = grpo_token_terms(logp, target, cfg, isw.weight if cfg.off_policy.decoupled else None)
    loss = (terms.loss * _selected(target[..., _MASK] > 0, target[..., _W])).sum()
    with torch.no_grad():
        stats = LossStats.of(float(loss.detach()), _terms_sums(terms), isw, target[..., _MASK])
    return loss, stats


def grpo_microbatch_loss(logits: torch.Tensor, target: torch.Tensor, cfg: LossConfig):
    """(loss scalar, LossStats) of one microbatch. logits: [B, T, V]; target: [B, T, F]."""
    return grpo_logp_loss(token_logp(logits, target[..., _NEXT], cfg.temperature), target, cfg)


def _chunk_logp(h: torch.Tensor, weight: torch.Tensor, next_ids: torch.Tensor, temperature: float):
    """(z [c, V] fp32 = h W^T / T_s, logsumexp(z) [c], logp [c]) of one chunk."""
    z = (h @ weight.t()).float().div_(temperature)  # (c, V): the only vocab-sized tensor of a chunk
    lse = torch.logsumexp(z, dim=-1)
    return z, lse, z.gather(-1, next_ids[:, None]).squeeze(-1) - lse


def _logp_of_chunks(h: torch.Tensor, weight: torch.Tensor, next_ids: torch.Tensor, temperature: float,
                    chunk_tokens: int) -> torch.Tensor:
    """logp [n] of the rows of h [n, H], one [chunk_tokens, V] block of logits at a time."""
    logp = torch.empty(h.shape[0], dtype=torch.float32, device=h.device)
    for start in range(0, h.shape[0], chunk_tokens):
        rows = slice(start, start + chunk_tokens)
        logp[rows] = _chunk_logp(h[rows], weight, next_ids[rows], temperature)[2]
    return logp


def _logp_grad(logp: torch.Tensor, target: torch.Tensor, cfg: LossConfig,
               is_weight: Optional[torch.Tensor]) -> torch.Tensor:
    """g = d (sum_t W_t l_t) / d logp [m] (one chunk, or all n tokens), by autograd on a leaf copy."""
    with torch.enable_grad():
        lp = logp.detach().requires_grad_()
        terms = grpo_token_terms(lp, target, cfg, is_weight)
        (g,) = torch.autograd.grad((terms.loss * target[:, _W]).sum(), lp)
    return g


class _ChunkedGRPOLoss(torch.autograd.Function):
    """sum_t W_t l_t over completion tokens, chunk by chunk (module docstring).
    h: [n, H]; weight: [V, H]; target: [n, F]; is_weight: [n] or None
    -> (loss scalar, [kl, behav_kl, clip_low, clip_high, dual_clip] sums).

    Token ratios: each chunk's loss and g come from that chunk's terms. Sequence ratios: the loss
    and g come from the terms of the whole logp [n], kept from the forward."""

    @staticmethod
    def forward(ctx, h, weight, target, is_weight, cfg: LossConfig, chunk_tokens: int):
        logp = None
        if cfg.ratio_level == "sequence":
            logp = _logp_of_chunks(h, weight, target[:, _NEXT].long(), cfg.temperature, chunk_tokens)
            terms = grpo_token_terms(logp, target, cfg, is_weight)
            loss, sums = (terms.loss * target[:, _W]).sum(), _terms_sums(terms)
        else:
            loss = torch.zeros((), dtype=torch.float32, device=h.device)
            sums = torch.zeros(len(TokenTerms._fields) - 1, dtype=torch.float32, device=h.device)
            for start in range(0, h.shape[0], chunk_tokens):
                h_c, t_c = h[start:start + chunk_tokens], target[start:start + chunk_tokens]
                w_c = None if is_weight is None else is_weight[start:start + chunk_tokens]
                _, _, logp_c = _chunk_logp(h_c, weight, t_c[:, _NEXT].long(), cfg.temperature)
                terms = grpo_token_terms(logp_c, t_c, cfg, w_c)
                loss += (terms.loss * t_c[:, _W]).sum()
                sums += _terms_sums(terms)
        ctx.save_for_backward(h, weight, target, is_weight, logp)
        ctx.cfg, ctx.chunk_tokens = cfg, chunk_tokens
        ctx.mark_non_differentiable(sums)
        return loss, sums

    @staticmethod
    def backward(ctx, grad_loss, _grad_sums):
        h, weight, target, is_weight, logp = ctx.saved_tensors
        cfg, c = ctx.cfg, ctx.chunk_tokens
        grad_h = torch.empty_like(h) if ctx.needs_input_grad[0] else None
        grad_w = torch.zeros_like(weight) if ctx.needs_input_grad[1] else None
        g_all = None if logp is None else _logp_grad(logp, target, cfg, is_weight) * grad_loss  # [n]
        for start in range(0, h.shape[0], c):
            h_c, t_c = h[start:start + c], target[start:start + c]
            next_ids = t_c[:, _NEXT].long()
            z, lse, logp_c = _chunk_logp(h_c, weight, next_ids, cfg.temperature)
            if g_all is None:  # g_t = d loss / d logp_t from the chunk's per-token terms, [c] only
                w_c = None if is_weight is None else is_weight[start:start + c]
                g = _logp_grad(logp_c, t_c, cfg, w_c) * grad_loss
            else:
                g = g_all[start:start + c]
            dz = z.sub_(lse[:, None]).exp_().mul_(-g[:, None])  # -g_t softmax(z), in z's buffer
            dz.scatter_add_(-1, next_ids[:, None], g[:, None])  # + g_t at the next token
            dz = dz.div_(cfg.temperature).to(h.dtype)  # d loss / d logits
            if grad_h is not None:
                grad_h[start:start + c] = dz @ weight
            if grad_w is not None:
                grad_w.addmm_(dz.t(), h_c)
        return grad_h, grad_w, None, None, None, None


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
    idx = (flat_t[:, _MASK] > 0).nonzero().squeeze(-1)  # (n,) completion-token positions
    # An empty selection still yields a loss connected to ``hidden`` (zero gradient): the pipeline
    # runs backward on every microbatch, empty ones too.
    h, t = hidden.reshape(-1, H)[idx], flat_t[idx]  # (n, H), (n, F)
    if cfg.off_policy.decoupled and cfg.off_policy.proximal == "current":
        with torch.no_grad():  # pi_prox = the current weights: one forward-only pass of the head
            current = torch.cat([token_logp(lm_head(h_c), n_c, cfg.temperature) for h_c, n_c in
                                 zip(h.detach().split(chunk_tokens), t[:, _NEXT].split(chunk_tokens))]) \
                if len(idx) else h.new_zeros(0)
        t = _with_current_proximal(t, current, cfg.off_policy)
    # The importance weights see every token of a sequence at once (sequence levels), before chunking.
    isw = importance_weights(t, cfg.off_policy)
    loss, sums = _ChunkedGRPOLoss.apply(h, lm_head.weight, t, isw.weight if cfg.off_policy.decoupled else None,
                                        cfg, chunk_tokens)
    stats = LossStats.of(float(loss.detach()), sums, isw, t[:, _MASK])
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
