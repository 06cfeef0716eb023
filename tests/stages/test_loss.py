"""The GRPO loss against numbers worked by hand: both sides of the asymmetric clip, dual-clip, the
k3 KL and its clamp, masked slots holding inf / nan, and the on-policy case equal bit for bit to
the plain loss."""

from __future__ import annotations

import math

import pytest
import torch

from stages.train.loss import (TARGET_FIELDS, LossConfig, LossStats, OffPolicyConfig, grpo_chunked_loss,
                               grpo_logp_loss, grpo_microbatch_loss)

F = {name: k for k, name in enumerate(TARGET_FIELDS)}


def make_target(logp_old, adv, ref=None, weight=None, prox=None, sample=None, mask=None) -> torch.Tensor:
    """[1, n, F] target from per-token lists (next_id 0; ref / prox default to old, weight to 1/n)."""
    n = len(logp_old)
    t = torch.zeros(1, n, len(TARGET_FIELDS))
    t[0, :, F["mask"]] = torch.tensor(mask if mask is not None else [1.0] * n)
    t[0, :, F["advantage"]] = torch.tensor(adv, dtype=torch.float32)
    t[0, :, F["old_logp"]] = torch.tensor(logp_old, dtype=torch.float32)
    t[0, :, F["ref_logp"]] = torch.tensor(ref if ref is not None else logp_old, dtype=torch.float32)
    t[0, :, F["weight"]] = torch.tensor(weight if weight is not None else [1.0 / n] * n, dtype=torch.float32)
    t[0, :, F["prox_logp"]] = torch.tensor(prox if prox is not None else logp_old, dtype=torch.float32)
    t[0, :, F["sample_id"]] = torch.tensor(sample if sample is not None else [0.0] * n)
    return t


def loss_and_grad(logp, target, cfg):
    lp = torch.tensor([logp], dtype=torch.float32, requires_grad=True)
    loss, stats = grpo_logp_loss(lp, target, cfg)
    (g,) = torch.autograd.grad(loss, lp)
    return float(loss.detach()), g[0].tolist(), stats


# Six tokens, old log-prob 0 (so r = exp(logp)), eps_low = 0.2, eps_high = 0.28, weights 1/6:
#  r    A     -min(rA, clip(r)A)                       d/dlogp (= -rA unless the clip binds)
#  1.5  +1    -min(1.5, 1.28)   = -1.28  (clip high)   0
#  0.5  -1    -min(-0.5, -0.8)  = +0.8   (clip low)    0
#  1.1  +2    -min(2.2, 2.2)    = -2.2                 -2.2
#  0.5  +1    -min(0.5, 0.8)    = -0.5   (no clip)     -0.5
#  2.0  -1    -min(-2, -1.28)   = +2.0   (no clip)     +2.0
#  4.0  -0.5  -min(-2, -0.64)   = +2.0   (no clip)     +2.0
# sum = -1.28 + 0.8 - 2.2 - 0.5 + 2 + 2 = 0.82, loss = 0.82 / 6.
# Dual-clip with c = 3 bounds A < 0 tokens at -c A: token 5, bound 3 > 2, stays; token 6, bound
# 1.5 < 2, becomes 1.5 with gradient 0: sum = 0.32, loss = 0.32 / 6.
_R = [1.5, 0.5, 1.1, 0.5, 2.0, 4.0]
_A = [1.0, -1.0, 2.0, 1.0, -1.0, -0.5]
_CLIP = LossConfig(clip_eps_low=0.2, clip_eps_high=0.28, kl_beta=0.0)


def test_clip_both_sides_asymmetric_eps():
    loss, grad, stats = loss_and_grad([math.log(r) for r in _R], make_target([0.0] * 6, _A), _CLIP)
    assert loss == pytest.approx(0.82 / 6, rel=1e-6)
    assert grad == pytest.approx([0.0, 0.0, -2.2 / 6, -0.5 / 6, 2.0 / 6, 2.0 / 6], rel=1e-6, abs=1e-7)
    m = stats.metrics()
    assert (m["clip_fraction_low"], m["clip_fraction_high"], m["clip_fraction"]) == pytest.approx((1 / 6, 1 / 6, 2 / 6))
    assert m["dual_clip_fraction"] == 0.0 and stats.tokens == 6


def test_dual_clip_bounds_negative_advantages():
    cfg = LossConfig(0.2, 0.28, 0.0, off_policy=OffPolicyConfig(dual_clip=True, dual_clip_c=3.0))
    loss, grad, stats = loss_and_grad([math.log(r) for r in _R], make_target([0.0] * 6, _A), cfg)
    assert loss == pytest.approx(0.32 / 6, rel=1e-6)
    assert grad == pytest.approx([0.0, 0.0, -2.2 / 6, -0.5 / 6, 2.0 / 6, 0.0], rel=1e-6, abs=1e-7)
    assert stats.dual_clip_sum == 1 and stats.clip_low_sum == 1 and stats.clip_high_sum == 1


# k3 with A = 0 (no surrogate), beta = 0.1, weights 1/2; delta = ref - logp, logp = log 0.5:
#  ref = log 0.25: delta = log 0.5, k3 = 0.5 - log 0.5 - 1 = 0.193147, d k3/d logp = 1 - e^delta = 0.5
#  ref = log 1:    delta = log 2,   k3 = 2 - log 2 - 1   = 0.306853, d k3/d logp = 1 - 2       = -1
# loss = 0.1 * (0.193147 + 0.306853) / 2 = 0.025; grad = 0.1 * [0.5, -1] / 2 = [0.025, -0.05].
# kl_clamp = 0.25 caps the second at 0.25 (gradient 0): loss = 0.1 * 0.443147 / 2.
def test_k3_kl_value_gradient_and_clamp():
    logp, ref, adv = [math.log(0.5)] * 2, [math.log(0.25), 0.0], [0.0, 0.0]
    cfg = LossConfig(0.2, 0.2, kl_beta=0.1)
    loss, grad, stats = loss_and_grad(logp, make_target(logp, adv, ref=ref), cfg)
    assert loss == pytest.approx(0.025, rel=1e-6)
    assert grad == pytest.approx([0.025, -0.05], rel=1e-5)
    assert stats.metrics()["kl"] == pytest.approx(0.25, rel=1e-6)  # (0.193147 + 0.306853) / 2
    clamped = LossConfig(0.2, 0.2, kl_beta=0.1, off_policy=OffPolicyConfig(kl_clamp=0.25))
    loss, grad, _ = loss_and_grad(logp, make_target(logp, adv, ref=ref), clamped)
    assert loss == pytest.approx(0.1 * (0.5 + math.log(2) - 1 + 0.25) / 2, rel=1e-6)
    assert grad == pytest.approx([0.025, 0.0], rel=1e-5, abs=1e-8)


def test_log_ratio_is_clamped_before_exp():
    # logp - old = 100 would overflow exp in float32; clamped at 20 the ratio is e^20 and the
    # gradient through the clamp is 0. A = -1, no dual clip: loss = e^20 / 1.
    loss, grad, _ = loss_and_grad([0.0], make_target([-100.0], [-1.0], weight=[1.0]), _CLIP)
    assert loss == pytest.approx(math.exp(20), rel=1e-6) and grad == [0.0]


@pytest.mark.parametrize("poison", [float("nan"), float("inf"), float("-inf")])
def test_masked_slots_cannot_leak_non_finite_values(poison):
    mask = [1.0, 0.0, 1.0, 0.0]
    clean = make_target([-1.0, -1.0, -0.5, -2.0], [1.0, 1.0, -1.0, 1.0], ref=[-1.2, -1.0, -0.4, -2.0],
                        weight=[0.5, 0.0, 0.5, 0.0], mask=mask)
    poisoned = clean.clone()
    for name in ("advantage", "old_logp", "ref_logp", "weight", "prox_logp"):
        poisoned[0, 1, F[name]] = poison
        poisoned[0, 3, F[name]] = poison
    logp = [-0.9, poison, -0.6, poison]
    # Multiplying by the mask instead of selecting leaks: 0 * nan = nan, 0 * inf = nan.
    leaky = plain_grpo_loss(torch.tensor([logp]), poisoned, LossConfig(0.2, 0.28, kl_beta=0.1))
    assert not math.isfinite(float(leaky))
    for off in (OffPolicyConfig(), OffPolicyConfig(decoupled=True, proximal="pass", is_level="sequence", dual_clip=True)):
        cfg = LossConfig(0.2, 0.28, kl_beta=0.1, off_policy=off)
        want_loss, want_grad, _ = loss_and_grad([-0.9, 0.0, -0.6, 0.0], clean, cfg)
        got_loss, got_grad, stats = loss_and_grad(logp, poisoned, cfg)
        assert got_loss == want_loss and got_grad == want_grad
        assert all(math.isfinite(g) for g in got_grad) and got_grad[1] == got_grad[3] == 0.0
        assert all(math.isfinite(v) for v in stats.metrics().values())


def plain_grpo_loss(logp, target, cfg: LossConfig) -> torch.Tensor:
    """The on-policy loss as written before off-policy corrections (independent reference)."""
    mask, adv = target[..., F["mask"]], target[..., F["advantage"]]
    old, ref = target[..., F["old_logp"]], target[..., F["ref_logp"]]
    ratio = torch.exp((logp - old) * mask)
    clipped_ratio = ratio.clamp(1.0 - cfg.clip_eps_low, 1.0 + cfg.clip_eps_high)
    surrogate = -torch.minimum(ratio * adv, clipped_ratio * adv)
    delta = (ref - logp) * mask
    kl = torch.exp(delta) - delta - 1.0
    return (((surrogate + cfg.kl_beta * kl) * mask) * target[..., F["weight"]]).sum()


def random_target(B: int, T: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    t = torch.zeros(B, T, len(TARGET_FIELDS))
    t[..., F["mask"]] = (torch.rand(B, T, generator=gen) < 0.7).float()
    t[..., F["advantage"]] = torch.randn(B, T, generator=gen)
    t[..., F["old_logp"]] = -1.0 + 0.5 * torch.randn(B, T, generator=gen)
    t[..., F["ref_logp"]] = t[..., F["old_logp"]] + 0.1 * torch.randn(B, T, generator=gen)
    t[..., F["prox_logp"]] = t[..., F["old_logp"]]  # on-policy: prox = behav
    t[..., F["sample_id"]] = torch.arange(B, dtype=torch.float32)[:, None]
    t[..., F["weight"]] = t[..., F["mask"]] / t[..., F["mask"]].sum()
    return t


@pytest.mark.parametrize("off", [
    OffPolicyConfig(),
    OffPolicyConfig(decoupled=True, proximal="pass", is_level="token", is_mode="truncate", is_cap=1.0),
    OffPolicyConfig(decoupled=True, proximal="pass", is_level="sequence", is_mode="mask", is_cap=1.0),
    OffPolicyConfig(decoupled=True, proximal="pass", is_level="geometric", is_mode="none"),
])
def test_on_policy_equals_plain_loss_bit_for_bit(off):
    target = random_target(3, 9, seed=4)
    logp = (target[..., F["old_logp"]] + 0.3 * torch.randn(3, 9, generator=torch.Generator().manual_seed(5)))
    cfg = LossConfig(0.2, 0.28, kl_beta=0.1, off_policy=off)
    lp_ref, lp = logp.clone().requires_grad_(), logp.clone().requires_grad_()
    want = plain_grpo_loss(lp_ref, target, cfg)
    got, stats = grpo_logp_loss(lp, target, cfg)
    assert torch.equal(got, want)
    assert torch.equal(torch.autograd.grad(got, lp)[0], torch.autograd.grad(want, lp_ref)[0])
    m = stats.metrics()
    assert m["is_weight_mean"] == 1.0 and m["is_weight_max"] == 1.0
    assert m["is_truncated_fraction"] == m["is_masked_fraction"] == 0.0


@pytest.mark.parametrize("proximal", ["pass", "current"])
def test_chunked_loss_equals_full_logits_loss_off_policy(proximal):
    """Sequence-level weights see whole sequences even when chunks split them; the current-weights
    anchor is the same log-prob on both paths."""
    torch.manual_seed(0)
    head = torch.nn.Linear(8, 13, bias=False)
    hidden = torch.randn(3, 7, 8, requires_grad=True)
    target = random_target(3, 7, seed=1)
    target[..., F["next_id"]] = torch.randint(0, 13, (3, 7)).float()
    target[..., F["prox_logp"]] += 0.4 * torch.randn(3, 7)
    off = OffPolicyConfig(decoupled=True, proximal=proximal, is_level="sequence", is_mode="mask", is_cap=1.5,
                          dual_clip=True)
    cfg = LossConfig(0.2, 0.28, kl_beta=0.1, off_policy=off)
    full, full_stats = grpo_microbatch_loss(head(hidden), target, cfg)
    assert_chunked_equals_full(hidden, target, head, cfg, full, full_stats, (1, 4))


def assert_chunked_equals_full(hidden, target, head, cfg, full, full_stats, chunks) -> None:
    """grpo_chunked_loss at each chunk size gives ``full`` (the logits path's loss of the same
    microbatch), its gradients w.r.t. hidden and the head's weight, and its stats."""
    g_full = torch.autograd.grad(full, (hidden, head.weight))
    for chunk in chunks:
        chunked, stats = grpo_chunked_loss(hidden, target, head, cfg, chunk)
        for a, b in zip(torch.autograd.grad(chunked, (hidden, head.weight)), g_full):
            torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)
        torch.testing.assert_close(chunked, full, atol=1e-6, rtol=1e-6)
        for got, want in zip(stats.sums() + [stats.is_weight_max], full_stats.sums() + [full_stats.is_weight_max]):
            assert got == pytest.approx(want, abs=1e-5)


def test_loss_stats_reduce_sums_and_max():
    a = LossStats(loss=1.0, tokens=4.0, clip_low_sum=1.0, is_weight_sum=5.0, is_weight_max=2.0)
    b = LossStats(loss=0.5, tokens=6.0, clip_high_sum=3.0, is_weight_sum=6.0, is_weight_max=1.5)
    a.add(b)
    m = a.metrics()
    assert m["loss"] == 1.5 and m["is_weight_max"] == 2.0  # a max, not a sum
    assert (m["clip_fraction_low"], m["clip_fraction_high"], m["is_weight_mean"]) == pytest.approx((0.1, 0.3, 1.1))


@pytest.mark.parametrize("kwargs, key", [({"is_level": "seq"}, "is_level"), ({"is_mode": "clip"}, "is_mode"),
                                         ({"is_cap": 0.5}, "is_cap"), ({"dual_clip_c": 1.0}, "dual_clip_c"),
                                         ({"kl_clamp": 0.0}, "kl_clamp"), ({"log_ratio_clamp": 0}, "log_ratio")])
def test_off_policy_config_names_the_bad_key(kwargs, key):
    with pytest.raises(ValueError, match=f"train.off_policy.{key}"):
        OffPolicyConfig(**kwargs)
