"""Policy drift under staleness and what PPO/GRPO clipping and importance-sampling fixes do with it.

Stated model (an assumption, not a measurement): a token's log-ratio log(pi_train / pi_behaviour)
is Gaussian with variance growing linearly in the lag k (independent per-step updates, a random walk):

    log r ~ N(-s^2/2, s^2),   s^2 = sigma_0^2 + k * sigma_step^2

so E[r] = 1. sigma_0 is the training/inference engine numerics mismatch present even on-policy
(Yao et al. 2025, "Your Efficient RL Framework Secretly Brings You Off-Policy RL Training");
sigma_step relates to the per-update KL as 2*KL ~ sigma_step^2. Real log-ratios are heavy-tailed:
a minority of high-entropy "forking" tokens moves most (Wang et al. 2025, "Beyond the 80/20 Rule").
So tokens are a two-part mixture: a share ``hot_share`` drifts with ``hot_multiplier`` times the std.

Clipping (PPO, Schulman 2017; GRPO, Shao 2024): tokens with A > 0 stop contributing above 1+eps_high,
tokens with A < 0 below 1-eps_low; with symmetric advantages half the tokens are exposed to each side.
Mitigations modelled:
- TIS (truncated IS): weight min(r, C) on the behaviour->proximal ratio; share truncated = P(r > C).
- MIS (masked IS): drop tokens with r outside [1/C, C].
- Decoupled PPO (Hilton et al. 2022): clip against a proximal policy pi_prox (the trainer's weights at the
  start of the step), so staleness and engine mismatch move into the (truncated) IS weight
  pi_prox / pi_behaviour and the clip only sees the drift since the snapshot: none with one optimiser
  update per step (pi_prox is then the detached log-prob of the same forward, no extra pass), at most
  sigma_step with several mini-batch updates (one extra forward pass to compute pi_prox).
- Bounded staleness: cap k.
A sequence-level ratio multiplies T token ratios, log-variance T*s^2: its effective sample size
exp(-T s^2) collapses for long reasoning traces, which is why the ratios here stay per token.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

__all__ = ["StalenessEstimate", "estimate_logratio_std", "estimate_staleness", "normal_cdf"]

_TIS_CAP = 2.0  # truncation / mask threshold C (Yao et al. 2025 use 2)


@dataclass(frozen=True, slots=True)
class StalenessEstimate:
    """Drift statistics at staleness ``staleness`` (policy versions between behaviour and trainer)."""

    staleness: int
    logratio_std: float
    outside_clip_fraction: float
    """tokens whose ratio leaves [1-eps_low, 1+eps_high]"""
    clipped_gradient_fraction: float
    """tokens whose gradient the clip zeroes (half the tokens face each side)"""
    clipped_gradient_fraction_decoupled: float
    """the same with decoupled PPO (clip against the proximal policy: only the in-step drift remains)"""
    tis_truncated_fraction: float
    mis_masked_fraction: float
    token_ess: float
    """effective sample size per token, 1/E[r^2] (exp(-s^2) per log-normal part)"""
    sequence_log10_ess: float
    """log10 ESS of a sequence-level ratio over gen_len tokens: -T s^2 / ln 10"""


def normal_cdf(x: float) -> float:
    """Standard normal CDF via erf."""
    return 0.5 * (1.0 + math.erf(x / math.sqrt(2.0)))


def estimate_logratio_std(staleness: int, sigma_step: float, sigma_mismatch: float) -> float:
    """s = sqrt(sigma_0^2 + k * sigma_step^2)."""
    return math.sqrt(sigma_mismatch**2 + staleness * sigma_step**2)


def _ratio_above(threshold: float, std: float) -> float:
    if std == 0:
        return 0.0 if threshold >= 1 else 1.0
    return 1.0 - normal_cdf((math.log(threshold) + std**2 / 2) / std)


def _ratio_below(threshold: float, std: float) -> float:
    if std == 0:
        return 0.0 if threshold <= 1 else 1.0
    return normal_cdf((math.log(threshold) + std**2 / 2) / std)


def _mixture(fn, std: float, hot_share: float, hot_multiplier: float) -> float:
    """Share-weighted value of ``fn(std)`` over the cold and the hot token populations."""
    return (1 - hot_share) * fn(std) + hot_share * fn(hot_multiplier * std)


def _clipped(std: float, eps_low: float, eps_high: float, hot_share: float, hot_multiplier: float) -> tuple[float, float]:
    above = _mixture(lambda s: _ratio_above(1 + eps_high, s), std, hot_share, hot_multiplier)
    below = _mixture(lambda s: _ratio_below(1 - eps_low, s), std, hot_share, hot_multiplier)
    return above + below, 0.5 * (above + below)


def estimate_staleness(staleness: int, *, sigma_step: float, sigma_mismatch: float, eps_low: float,
                       eps_high: float, gen_len: int, hot_share: float = 0.2,
                       hot_multiplier: float = 4.0, updates_per_step: int = 1) -> StalenessEstimate:
    """Clip / truncation / ESS statistics of the stated log-normal mixture drift model at lag ``staleness``."""
    std = estimate_logratio_std(staleness, sigma_step, sigma_mismatch)
    outside, zeroed = _clipped(std, eps_low, eps_high, hot_share, hot_multiplier)
    in_step = sigma_step if updates_per_step > 1 else 0.0
    _, zeroed_decoupled = _clipped(in_step, eps_low, eps_high, hot_share, hot_multiplier)
    second_moment = _mixture(lambda s: math.exp(s**2), std, hot_share, hot_multiplier)  # E[r^2] of a log-normal
    log_var_mean = _mixture(lambda s: s**2, std, hot_share, hot_multiplier)
    return StalenessEstimate(
        staleness=staleness,
        logratio_std=std,
        outside_clip_fraction=outside,
        clipped_gradient_fraction=zeroed,
        clipped_gradient_fraction_decoupled=zeroed_decoupled,
        tis_truncated_fraction=_mixture(lambda s: _ratio_above(_TIS_CAP, s), std, hot_share, hot_multiplier),
        mis_masked_fraction=_mixture(lambda s: _ratio_above(_TIS_CAP, s) + _ratio_below(1 / _TIS_CAP, s),
                                     std, hot_share, hot_multiplier),
        token_ess=1.0 / second_moment,
        sequence_log10_ess=-gen_len * log_var_mean / math.log(10),
    )
