"""The off-policy section of the loss (``train.off_policy``): a torch-free config, so the run schema
(flows/schema.py) and the planner can import it without torch; stages/train/loss.py applies it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Optional

__all__ = ["IS_LEVELS", "IS_MODES", "PROXIMAL_SOURCES", "OffPolicyConfig"]

IS_LEVELS = ("token", "sequence", "geometric")
IS_MODES = ("none", "truncate", "mask")
PROXIMAL_SOURCES = ("current", "pass")


@dataclass(frozen=True)
class OffPolicyConfig:
    """Off-policy corrections and numerical guards of the loss (``train.off_policy``). The defaults
    leave the loss as the plain on-policy GRPO loss."""

    decoupled: bool = False
    """Decoupled PPO (Hilton et al. 2021; AReaL): clip r = pi_theta / pi_prox and weight each token
    by w = pi_prox / pi_behav (target channel prox_logp). False: clip pi_theta / pi_behav, w = 1."""
    proximal: Literal["current", "pass"] = "current"
    """Where pi_prox comes from. current: the trainer's weights at the start of the step, which are
    the weights its own forward runs with (one optimiser update per step), so pi_prox is that
    forward's log-prob, detached: no extra pass. pass: a forward-only ``proximal`` stage writes
    prox_logp to the store before train (the same values up to float rounding; a cross-check, and
    the form a multi-update step would need)."""
    is_level: Literal["token", "sequence", "geometric"] = "token"
    """token: w_t = exp(prox_t - behav_t). sequence: every token of sample i takes
    exp(sum_t (prox_t - behav_t)), the sequence likelihood ratio, unbiased but with a variance
    growing with length. geometric: exp(mean_t (prox_t - behav_t)), its per-token geometric mean,
    length-independent (GSPO, Zheng et al. 2025). The levels follow verl's rollout importance
    sampling (token / sequence / geometric; Yao et al. 2025, "Your efficient RL framework secretly
    brings you off-policy RL training"; Liu et al. 2025, "When speed kills stability")."""
    is_mode: Literal["none", "truncate", "mask"] = "truncate"
    """none: w as is. truncate (TIS): min(w, is_cap). mask (MIS): tokens, or at the sequence levels
    whole sequences, with w > is_cap get weight 0 (dropped from the surrogate; KL stays)."""
    is_cap: float = 2.0
    """C, the TIS cap / MIS threshold; >= 1 so that on-policy weights (exactly 1) are untouched."""
    dual_clip: bool = False
    """Dual-clip PPO (Ye et al. 2020): for A < 0 the surrogate loss is at most -dual_clip_c * A."""
    dual_clip_c: float = 3.0
    """c of dual-clip (verl's clip_ratio_c, default 3); > 1."""
    kl_clamp: Optional[float] = None
    """Upper bound on each token's k3 KL (>= 0 by construction); None: unbounded."""
    log_ratio_clamp: float = 20.0
    """Every log-ratio is clamped to [-b, b] before exp: exp(20) = 4.9e8 stays finite in float32
    (max 3.4e38) even summed over tokens, and the gradient through a clamped value is 0."""

    def __post_init__(self) -> None:
        if self.proximal not in PROXIMAL_SOURCES:
            raise ValueError(f"train.off_policy.proximal={self.proximal!r}: use one of {PROXIMAL_SOURCES}")
        if self.is_level not in IS_LEVELS:
            raise ValueError(f"train.off_policy.is_level={self.is_level!r}: use one of {IS_LEVELS}")
        if self.is_mode not in IS_MODES:
            raise ValueError(f"train.off_policy.is_mode={self.is_mode!r}: use one of {IS_MODES}")
        if not self.is_cap >= 1.0:
            raise ValueError(f"train.off_policy.is_cap={self.is_cap} must be >= 1 (on-policy weights are 1)")
        if not self.dual_clip_c > 1.0:
            raise ValueError(f"train.off_policy.dual_clip_c={self.dual_clip_c} must be > 1 (verl uses 3)")
        if self.kl_clamp is not None and not self.kl_clamp > 0:
            raise ValueError(f"train.off_policy.kl_clamp={self.kl_clamp} must be > 0, or unset")
        if not self.log_ratio_clamp > 0:
            raise ValueError(f"train.off_policy.log_ratio_clamp={self.log_ratio_clamp} must be > 0 (e.g. 20)")
