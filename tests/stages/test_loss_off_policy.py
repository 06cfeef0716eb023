"""Off-policy corrections and the aggregation weights against numbers worked by hand: decoupled
PPO's proximal anchor, TIS / MIS at the token, sequence and geometric levels, failed rewards out of
the denominators, and the target channels build_global_batch fills."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from stages.train.batch import aggregation_weights, build_global_batch
from stages.train.loss import TARGET_FIELDS, LossConfig, OffPolicyConfig, grpo_logp_loss

F = {name: k for k, name in enumerate(TARGET_FIELDS)}
_LN = math.log


def make_target(old, prox, adv, sample, weight) -> torch.Tensor:
    n = len(old)
    t = torch.zeros(1, n, len(TARGET_FIELDS))
    t[0, :, F["mask"]] = 1.0
    for name, values in (("old_logp", old), ("ref_logp", old), ("prox_logp", prox), ("advantage", adv),
                         ("sample_id", sample), ("weight", weight)):
        t[0, :, F[name]] = torch.tensor(values, dtype=torch.float32)
    return t


def loss_and_grad(logp, target, off: OffPolicyConfig):
    lp = torch.tensor([logp], dtype=torch.float32, requires_grad=True)
    loss, stats = grpo_logp_loss(lp, target, LossConfig(0.2, 0.28, kl_beta=0.0, off_policy=off))
    (g,) = torch.autograd.grad(loss, lp)
    return float(loss.detach()), g[0].tolist(), stats


def test_decoupled_clip_anchors_on_the_proximal_policy():
    # behav = 0, prox = log 2 (w = 2), logp = log 3, A = -1, cap 2.5 (no truncation):
    # r = pi / pi_prox = 1.5; -min(-1.5, -1.28) = 1.5; loss = w * 1.5 = 3.0; d/dlogp = w * r = 3.0.
    # (Anchored on behav it would be r = 3, loss 3.)
    off = OffPolicyConfig(decoupled=True, proximal="pass", is_cap=2.5)
    loss, grad, stats = loss_and_grad([_LN(3)], make_target([0.0], [_LN(2)], [-1.0], [0], [1.0]), off)
    assert loss == pytest.approx(3.0, rel=1e-6) and grad == pytest.approx([3.0], rel=1e-6)
    assert stats.is_weight_max == pytest.approx(2.0) and stats.clip_low_sum == stats.clip_high_sum == 0
    # A = +1: r = 1.5 > 1.28 clips high: loss = -w * 1.28 = -2.56, gradient 0.
    loss, grad, stats = loss_and_grad([_LN(3)], make_target([0.0], [_LN(2)], [1.0], [0], [1.0]), off)
    assert loss == pytest.approx(-2.56, rel=1e-6) and grad == [0.0] and stats.clip_high_sum == 1


def test_current_proximal_is_the_trainers_own_log_prob():
    # proximal: current takes pi_prox = the current weights, whatever the stored channel holds.
    # behav = 0, logp = log 3 (so w = pi / pi_behav = 3, truncated to the cap 2), A = 1, weight 1:
    # r = pi / pi_prox = 1 exactly (no clip can bind in the step's single update), loss = -2 * 1,
    # d loss / d logp = -w * r = -2 (the detached anchor carries no gradient).
    off = OffPolicyConfig(decoupled=True, proximal="current", is_cap=2.0)
    stored_prox_ignored = make_target([0.0], [_LN(10)], [1.0], [0], [1.0])
    loss, grad, stats = loss_and_grad([_LN(3)], stored_prox_ignored, off)
    assert loss == pytest.approx(-2.0, rel=1e-6) and grad == pytest.approx([-2.0], rel=1e-6)
    assert stats.is_weight_max == pytest.approx(3.0) and stats.is_truncated_sum == 1
    assert stats.clip_low_sum == stats.clip_high_sum == 0
    # The same numbers as the stored pass when the stored channel holds exactly that log-prob.
    as_pass = OffPolicyConfig(decoupled=True, proximal="pass", is_cap=2.0)
    stored = make_target([0.0], [_LN(3)], [1.0], [0], [1.0])
    assert loss_and_grad([_LN(3)], stored, as_pass)[:2] == (loss, grad)


# Three tokens of one sample, logp = prox (r = 1, no clip), A = 1, weights 1/3, so each token's
# loss is -w_t and its gradient -w_t / 3. prox - behav = log 3, log 1.5, 0 -> w = 3, 1.5, 1; cap 2.
_TOKENS = make_target([0.0] * 3, [_LN(3), _LN(1.5), 0.0], [1.0] * 3, [0] * 3, [1 / 3] * 3)


@pytest.mark.parametrize("mode, w, truncated, masked", [
    ("truncate", [2.0, 1.5, 1.0], 1 / 3, 0.0),  # TIS: min(w, 2)
    ("mask", [0.0, 1.5, 1.0], 0.0, 1 / 3),  # MIS: w > 2 dropped
    ("none", [3.0, 1.5, 1.0], 0.0, 0.0),
])
def test_token_level_tis_and_mis(mode, w, truncated, masked):
    off = OffPolicyConfig(decoupled=True, proximal="pass", is_level="token", is_mode=mode, is_cap=2.0)
    loss, grad, stats = loss_and_grad([_LN(3), _LN(1.5), 0.0], _TOKENS, off)
    assert loss == pytest.approx(-sum(w) / 3, rel=1e-6)
    assert grad == pytest.approx([-x / 3 for x in w], rel=1e-6, abs=1e-8)
    m = stats.metrics()
    assert m["is_weight_mean"] == pytest.approx((3 + 1.5 + 1) / 3, rel=1e-6)  # before the cap
    assert m["is_weight_max"] == pytest.approx(3.0, rel=1e-6)
    assert (m["is_truncated_fraction"], m["is_masked_fraction"]) == pytest.approx((truncated, masked))


# Two samples of two tokens, logp = prox, A = 1, weights 1/4 (loss = -sum_t w_t / 4):
#   sample 0: prox - behav = log 2, log 2  -> product 4,   geometric mean 2
#   sample 1: prox - behav = log 1.5, 0   -> product 1.5, geometric mean sqrt(1.5) = 1.224745
_SEQS = make_target([0.0] * 4, [_LN(2), _LN(2), _LN(1.5), 0.0], [1.0] * 4, [0, 0, 1, 1], [0.25] * 4)
_G = math.sqrt(1.5)


@pytest.mark.parametrize("level, mode, cap, w", [
    ("sequence", "mask", 3.0, [0, 0, 1.5, 1.5]),  # 4 > 3: the whole of sample 0 is dropped
    ("sequence", "truncate", 3.0, [3, 3, 1.5, 1.5]),  # min(4, 3)
    ("geometric", "mask", 1.8, [0, 0, _G, _G]),  # 2 > 1.8 dropped; 1.2247 kept
    ("geometric", "mask", 3.0, [2, 2, _G, _G]),
    ("token", "mask", 1.8, [0, 0, 1.5, 1.0]),  # per token: both log-2 tokens dropped
])
def test_sequence_level_weights(level, mode, cap, w):
    off = OffPolicyConfig(decoupled=True, proximal="pass", is_level=level, is_mode=mode, is_cap=cap)
    logp = [_LN(2), _LN(2), _LN(1.5), 0.0]
    loss, grad, stats = loss_and_grad(logp, _SEQS, off)
    assert loss == pytest.approx(-sum(w) / 4, rel=1e-6)
    assert grad == pytest.approx([-x / 4 for x in w], rel=1e-6, abs=1e-8)
    assert stats.is_masked_sum == sum(x == 0 for x in w)


def test_sequence_weights_do_not_mix_samples_in_different_rows():
    # The same two samples, one per row of a [2, 2] microbatch: the same weights as one row.
    off = OffPolicyConfig(decoupled=True, proximal="pass", is_level="sequence", is_mode="mask", is_cap=3.0)
    logp = torch.tensor([[_LN(2), _LN(2)], [_LN(1.5), 0.0]], requires_grad=True)
    loss, _ = grpo_logp_loss(logp, _SEQS.reshape(2, 2, -1), LossConfig(0.2, 0.28, off_policy=off))
    assert float(loss.detach()) == pytest.approx(-3.0 / 4, rel=1e-6)


# lengths [2, 3, 1, 4, 2, 2], max_new_tokens 4, groups of 2. All trained:
#   token-mean: 1 / 14;  seq-mean-token-mean: 1 / (len * 6);  seq-mean-token-sum-norm: 1 / (4 * 6)
# Sample 1's reward failed: its group keeps only sample 0 (< 2 valid), so both are dropped;
# trained samples 2..5 hold 1 + 4 + 2 + 2 = 9 tokens:
#   token-mean: 1 / 9;  seq-mean-token-mean: 1 / (len * 4);  seq-mean-token-sum-norm: 1 / 16
_LENGTH = np.array([2, 3, 1, 4, 2, 2])
_TRAINED = np.array([False, False, True, True, True, True])


@pytest.mark.parametrize("mode, everyone, trained", [
    ("token-mean", [1 / 14] * 6, [0, 0] + [1 / 9] * 4),
    ("seq-mean-token-mean", [1 / 12, 1 / 18, 1 / 6, 1 / 24, 1 / 12, 1 / 12], [0, 0, 1 / 4, 1 / 16, 1 / 8, 1 / 8]),
    ("seq-mean-token-sum-norm", [1 / 24] * 6, [0, 0] + [1 / 16] * 4),
])
def test_aggregation_weights_by_hand(mode, everyone, trained):
    np.testing.assert_allclose(aggregation_weights(_LENGTH, 4, mode), everyone, rtol=1e-12)
    np.testing.assert_allclose(aggregation_weights(_LENGTH, 4, mode, _TRAINED), trained, rtol=1e-12)


def rollout_arrays(prox: bool) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    n, gw = len(_LENGTH), 4
    arrays = dict(prompt_ids=rng.integers(3, 50, (n, 3)), prompt_len=np.full(n, 2), tokens=rng.integers(3, 50, (n, gw)),
                  length=_LENGTH, behav_logp=-rng.random((n, gw)).astype(np.float32),
                  ref_logp=-rng.random((n, gw)).astype(np.float32), advantage=rng.normal(size=n).astype(np.float32))
    if prox:
        arrays["prox_logp"] = -rng.random((n, gw)).astype(np.float32)
    return arrays


@pytest.mark.parametrize("prox", [False, True])
def test_build_global_batch_fills_prox_and_drops_failed_samples(prox):
    arrays = rollout_arrays(prox)
    failed = np.array([False, True, False, False, False, False])
    batch = build_global_batch(arrays, "token-mean", 0, reward_failed=failed, group_size=2)
    t = batch.target
    for i, n in enumerate(_LENGTH):  # one row per sample; completion token j predicted at column 1 + j
        cols = slice(1, 1 + n)
        np.testing.assert_array_equal(t[i, cols, F["prox_logp"]].numpy(),
                                      arrays["prox_logp" if prox else "behav_logp"][i, :n])
        assert torch.all(t[i, cols, F["sample_id"]] == i)
        assert torch.all(t[i, cols, F["mask"]] == float(_TRAINED[i]))
        assert torch.all(t[i, cols, F["weight"]] == torch.tensor(1 / 9 if _TRAINED[i] else 0.0))
    # token-mean over the trained tokens sums to 1
    assert float((t[..., F["weight"]] * t[..., F["mask"]]).sum()) == pytest.approx(1.0, rel=1e-6)


def test_reward_failed_needs_group_size():
    with pytest.raises(ValueError, match="group_size"):
        build_global_batch(rollout_arrays(False), "token-mean", 0, reward_failed=np.zeros(6, bool))


def test_off_policy_microbatch_losses_sum_to_full_batch_loss():
    """With sequence-level weights, failed rewards and packed rows, the microbatch losses are still
    an exact split of the full-batch loss: a sequence never straddles two rows."""
    from conftest import make_model, make_rollout_arrays
    from stages.train.loss import grpo_microbatch_loss
    from stages.train.plan import microbatch_layout

    model = make_model()
    arrays = make_rollout_arrays(model, num_groups=4, group_size=4)
    rng = np.random.default_rng(1)
    noise = rng.normal(scale=0.3, size=arrays["behav_logp"].shape).astype(np.float32)
    arrays["prox_logp"] = arrays["behav_logp"] + noise
    failed = np.zeros(16, bool)
    failed[[1, 4, 5, 6]] = True  # group 1 keeps one valid sample: all four out
    layout = microbatch_layout(4, 4, 5, 6, 44, packing=True, pack_row_tokens=22)
    batch = build_global_batch(arrays, "seq-mean-token-mean", 0, layout, reward_failed=failed, group_size=4)
    off = OffPolicyConfig(decoupled=True, proximal="pass", is_level="sequence", is_mode="mask", is_cap=1.5, dual_clip=True)
    cfg = LossConfig(0.2, 0.28, kl_beta=0.1, off_policy=off)
    kw = batch.stage_kwargs()
    rows = batch.input_ids.shape[0] // layout.num_microbatches
    with torch.no_grad():
        full, stats = grpo_microbatch_loss(model(batch.input_ids, **kw), batch.target, cfg)
        parts = 0.0
        for s in range(0, batch.input_ids.shape[0], rows):
            logits = model(batch.input_ids[s:s + rows], **{k: v[s:s + rows] for k, v in kw.items()})
            parts = parts + grpo_microbatch_loss(logits, batch.target[s:s + rows], cfg)[0]
    torch.testing.assert_close(parts, full, rtol=1e-6, atol=1e-7)
    trained = np.ones(16, bool)
    trained[[1, 4, 5, 6, 7]] = False
    assert stats.tokens == arrays["length"][trained].sum()
    assert 0 < stats.is_masked_sum < stats.tokens  # the cap binds on some sequences, not all
