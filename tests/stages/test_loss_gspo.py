"""GSPO's sequence-level ratio (``LossConfig.ratio_level="sequence"``, ``train.policy_ratio``)
against numbers worked by hand: one clipped ratio per sequence given to each of its tokens, the
dual clip at sequence level, the k3 KL per token, the gradient equal to GRPO's on-policy in every
aggregation mode, the chunked loss equal to the full-logits one when chunks split sequences, and
the config key."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from flows.config import load_config
from test_loss import assert_chunked_equals_full
from stages.config import ConfigError
from stages.policy import DecoderConfig
from stages.train.setup import train_setup
from stages.train.batch import aggregation_weights
from stages.train.loss import (TARGET_FIELDS, LossConfig, OffPolicyConfig, grpo_chunked_loss, grpo_logp_loss,
                               grpo_microbatch_loss)

F = {name: k for k, name in enumerate(TARGET_FIELDS)}
_NAN = float("nan")


def make_target(rows: list[list[dict]]) -> torch.Tensor:
    """[B, T, F] target, one dict of channel values per slot ({} is a masked slot, nan everywhere)."""
    t = torch.full((len(rows), len(rows[0]), len(TARGET_FIELDS)), _NAN)
    t[..., F["mask"]] = 0.0
    for b, row in enumerate(rows):
        for j, slot in enumerate(row):
            if slot:
                t[b, j, F["mask"]] = 1.0
                t[b, j, F["next_id"]] = 0.0
                for name, value in slot.items():
                    t[b, j, F[name]] = value
    return t


def tokens(sample: int, old: list[float], log_ratio: list[float], adv: float, weight: float,
           ref: list[float] | None = None) -> tuple[list[dict], list[float]]:
    """(target slots, logp) of one sequence: logp = old + log_ratio; ref defaults to old."""
    ref = ref if ref is not None else old
    slots = [dict(sample_id=sample, old_logp=o, prox_logp=o, ref_logp=r, advantage=adv, weight=weight)
             for o, r in zip(old, ref)]
    return slots, [o + d for o, d in zip(old, log_ratio)]


def loss_and_grad(logp: list[list[float]], target: torch.Tensor, cfg: LossConfig):
    lp = torch.tensor(logp, dtype=torch.float32, requires_grad=True)
    loss, stats = grpo_logp_loss(lp, target, cfg)
    (g,) = torch.autograd.grad(loss, lp)
    return float(loss.detach()), g, stats


_GSPO = LossConfig(clip_eps_low=0.2, clip_eps_high=0.28, kl_beta=0.0, ratio_level="sequence")


# Three sequences packed in two rows, seq-mean-token-mean weights 1 / (3 |y_i|), eps 0.2 / 0.28:
#  seq  |y|  log-ratios       mean  s = e^mean  A     l_i = -min(s A, clip(s) A)        d l_i / d s
#  a    2    0.3, 0.1         0.2   1.221403    +1    -1.221403          (no clip)     -1
#  b    3    0.5, 0.4, 0.3    0.4   1.491825    +0.5  -1.28 * 0.5 = -0.64 (clip high)  0
#  c    1    -0.1             -0.1  0.904837    -1    +0.904837          (no clip)     +1
# loss = sum_t W_t l_t = (l_a + l_b + l_c) / 3, the paper's mean over sequences.
# d loss / d logp_t = (sum_{t in i} W_t) (d l_i / d s) s_i / |y_i|: a: (1/3)(-1) s_a / 2 per token,
# b: 0, c: (1/3)(+1) s_c. The clip counts b's 3 tokens; per token (GRPO) a's first token, r = e^0.3
# = 1.35, would clip as well.
def _three_sequences():
    a, lp_a = tokens(0, [-1.0, -0.5], [0.3, 0.1], adv=1.0, weight=1 / 6)
    c, lp_c = tokens(2, [-2.0], [-0.1], adv=-1.0, weight=1 / 3)
    b, lp_b = tokens(1, [-0.7, -1.2, -0.9], [0.5, 0.4, 0.3], adv=0.5, weight=1 / 9)
    target = make_target([a + c + [{}], b + [{}]])
    return target, [lp_a + lp_c + [_NAN], lp_b + [_NAN]]


def test_sequence_ratio_clips_whole_sequences():
    target, logp = _three_sequences()
    s_a, s_c = math.exp(0.2), math.exp(-0.1)
    loss, grad, stats = loss_and_grad(logp, target, _GSPO)
    assert loss == pytest.approx((-s_a - 0.64 + s_c) / 3, rel=1e-6)
    want = [[-s_a / 6, -s_a / 6, s_c / 3, 0.0], [0.0, 0.0, 0.0, 0.0]]
    torch.testing.assert_close(grad, torch.tensor(want), rtol=1e-6, atol=1e-7)
    assert (stats.clip_high_sum, stats.clip_low_sum, stats.tokens) == (3, 0, 6)  # b's three tokens
    assert stats.metrics()["clip_fraction"] == 0.5
    _, _, token_stats = loss_and_grad(logp, target, LossConfig(0.2, 0.28, kl_beta=0.0))
    assert token_stats.clip_high_sum == 4  # GRPO: a's first token and b's three


# Dual clip (c = 3) and the k3 KL (beta = 0.1, ref = old, so delta_t = ref - logp = -log-ratio),
# seq-mean-token-sum-norm weights 1 / (4 * 3) = 1/12, every A = -1:
#  seq  log-ratios    s                   -min(-s, -clip(s))         dual bound 3
#  d    1.5, 0.7      e^1.1  = 3.004166   3.004166                   binds: l_d = 3 (2 tokens)
#  e    -0.5, -0.1    e^-0.3 = 0.740818   0.8      (clip low, 2 tokens)  l_e = 0.8
#  f    0.2           e^0.2  = 1.221403   1.221403                   l_f = 1.221403
# loss = (1/12) (2 * 3 + 2 * 0.8 + 1.221403 + 0.1 sum_t k3_t),  k3 = e^delta - delta - 1.
# Gradients: d and e only through KL, (1/12) 0.1 (1 - e^delta_t); f: (1/12) (s_f + 0.1 (1 - e^-0.2)).
def test_sequence_dual_clip_and_per_token_kl():
    d, lp_d = tokens(0, [-1.0, -2.0], [1.5, 0.7], adv=-1.0, weight=1 / 12)
    e, lp_e = tokens(1, [-0.4, -0.6], [-0.5, -0.1], adv=-1.0, weight=1 / 12)
    f, lp_f = tokens(2, [-1.5], [0.2], adv=-1.0, weight=1 / 12)
    target = make_target([d + e + f])
    cfg = LossConfig(0.2, 0.28, kl_beta=0.1, ratio_level="sequence",
                     off_policy=OffPolicyConfig(dual_clip=True, dual_clip_c=3.0))
    loss, grad, stats = loss_and_grad([lp_d + lp_e + lp_f], target, cfg)
    deltas = [-1.5, -0.7, 0.5, 0.1, -0.2]
    k3 = [math.exp(x) - x - 1 for x in deltas]
    s_f = math.exp(0.2)
    assert loss == pytest.approx((6 + 1.6 + s_f + 0.1 * sum(k3)) / 12, rel=1e-6)
    kl_grad = [0.1 * (1 - math.exp(x)) / 12 for x in deltas]
    want = kl_grad[:4] + [kl_grad[4] + s_f / 12]
    torch.testing.assert_close(grad[0], torch.tensor(want), rtol=1e-5, atol=1e-7)
    assert (stats.dual_clip_sum, stats.clip_low_sum, stats.clip_high_sum) == (2, 2, 0)
    assert stats.metrics()["kl"] == pytest.approx(sum(k3) / 5, rel=1e-6)


# On-policy (logp = anchor: every ratio 1, no clip) GSPO's gradient is GRPO's: token t of sequence
# i gets (sum_{t' in i} W_t') (-A_i) / |y_i| = -W_t A_i, as every mode keeps W constant over a
# sequence; the KL term is the same per-token term. Five sequences of lengths 3, 1, 4, 2, 5 packed
# in two rows of 8. Decoupled PPO anchored on the current weights has ratio 1 too, and with a
# sequence-level (here geometric) importance weight the two still agree off-policy.
_LENGTHS = [3, 1, 4, 2, 5]


def _on_policy_batch(mode: str, off: OffPolicyConfig, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    w = aggregation_weights(np.array(_LENGTHS), max(_LENGTHS), mode)
    seqs = []
    for i, n in enumerate(_LENGTHS):
        old = (-1.0 + 0.5 * torch.randn(n, generator=gen)).tolist()
        ref = [o + 0.2 * float(torch.randn((), generator=gen)) for o in old]
        seqs.append(tokens(i, old, [0.0] * n, adv=float(torch.randn((), generator=gen)), weight=float(w[i]),
                           ref=ref))
    rows = [seqs[0][0] + seqs[1][0] + seqs[2][0], seqs[3][0] + seqs[4][0] + [{}]]
    logp = [seqs[0][1] + seqs[1][1] + seqs[2][1], seqs[3][1] + seqs[4][1] + [_NAN]]
    target = make_target(rows)
    if off.decoupled:  # the behaviour policy moves away; the anchor is the current weights' logp
        target[..., F["old_logp"]] += 0.3 * torch.randn(target.shape[:2], generator=gen)
    return target, torch.tensor(logp)


@pytest.mark.parametrize("off", [
    OffPolicyConfig(),
    OffPolicyConfig(decoupled=True, proximal="current", is_level="geometric", is_mode="truncate", is_cap=1.2),
])
@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"])
def test_on_policy_gradient_equals_grpo(mode, off):
    target, logp = _on_policy_batch(mode, off, seed=3)
    results = []
    for level in ("token", "sequence"):
        lp = logp.clone().requires_grad_()
        loss, stats = grpo_logp_loss(lp, target, LossConfig(0.2, 0.28, kl_beta=0.1, off_policy=off, ratio_level=level))
        results.append((loss, torch.autograd.grad(loss, lp)[0], stats))
    (loss_t, grad_t, stats_t), (loss_s, grad_s, stats_s) = results
    assert grad_t.abs().sum() > 0 and stats_s.clipped_sum == stats_t.clipped_sum == 0
    # Exact up to the rounding of summing |y_i| equal weights and dividing by |y_i|.
    torch.testing.assert_close(grad_s, grad_t, rtol=1e-6, atol=1e-9)
    torch.testing.assert_close(loss_s, loss_t, rtol=1e-6, atol=1e-9)
    one_token = torch.tensor([[False, False, False, True, False, False, False, False], [False] * 8])
    assert torch.equal(grad_s[one_token], grad_t[one_token])  # |y| = 1: the same arithmetic


# The chunked loss against the full-logits loss: four sequences (lengths 4, 3, 5, 3 behind masked
# prompt slots) whose anchors are shifted per sequence so that a clip binds high on one, low on
# another and the dual clip on a third; chunks of 2, 4 and 6 split sequences.
_SHIFT = {0: -0.5, 1: 0.4, 2: -0.05, 3: -1.5}  # anchor = logp + shift, so the mean log-ratio is -shift
_ADV = {0: 1.0, 1: -1.0, 2: 0.7, 3: -2.0}
_LAYOUT = [[None, None, 0, 0, 0, 0, 1, 1, 1], [None, 2, 2, 2, 2, 2, 3, 3, 3]]  # sample of each slot


def _chunk_case(off: OffPolicyConfig):
    torch.manual_seed(0)
    head = torch.nn.Linear(8, 13, bias=False)
    hidden = torch.randn(2, 9, 8, requires_grad=True)
    target = torch.zeros(2, 9, len(TARGET_FIELDS))
    target[..., F["next_id"]] = torch.randint(0, 13, (2, 9)).float()
    with torch.no_grad():
        logp = torch.log_softmax(head(hidden), -1).gather(-1, target[..., F["next_id"]].long()[..., None])[..., 0]
    gen = torch.Generator().manual_seed(1)
    for b, row in enumerate(_LAYOUT):
        for j, i in enumerate(row):
            if i is None:
                continue
            anchor = float(logp[b, j]) + _SHIFT[i] + 0.05 * float(torch.randn((), generator=gen))
            slot = dict(mask=1.0, sample_id=i, advantage=_ADV[i], weight=1 / (4 * row.count(i)),
                        old_logp=anchor - 0.2 if off.decoupled else anchor, prox_logp=anchor,
                        ref_logp=float(logp[b, j]) + 0.1 * float(torch.randn((), generator=gen)))
            for name, value in slot.items():
                target[b, j, F[name]] = value
    return head, hidden, target


@pytest.mark.parametrize("off", [
    OffPolicyConfig(dual_clip=True, dual_clip_c=3.0),
    OffPolicyConfig(decoupled=True, proximal="pass", is_level="sequence", is_mode="truncate", is_cap=1.1,
                    dual_clip=True),
])
def test_chunked_loss_equals_full_logits_loss(off):
    head, hidden, target = _chunk_case(off)
    cfg = LossConfig(0.2, 0.28, kl_beta=0.1, off_policy=off, ratio_level="sequence")
    full, full_stats = grpo_microbatch_loss(head(hidden), target, cfg)
    assert full_stats.clip_high_sum == 4 and full_stats.clip_low_sum == 3 and full_stats.dual_clip_sum == 3
    assert_chunked_equals_full(hidden, target, head, cfg, full, full_stats, (1, 2, 4, 6, 15, 64))


def test_chunked_loss_of_an_empty_microbatch():
    head, hidden, target = _chunk_case(OffPolicyConfig())
    target[..., F["mask"]] = 0.0
    loss, stats = grpo_chunked_loss(hidden, target, head, _GSPO, 4)
    g_hidden, g_weight = torch.autograd.grad(loss, (hidden, head.weight))
    assert float(loss.detach()) == 0.0 and stats.tokens == 0
    assert not g_hidden.any() and not g_weight.any()


def test_policy_ratio_config():
    small = ["task.prompts_per_step=16", "train.micro_batch_size=32"]
    with pytest.raises(ConfigError) as info:
        load_config("configs/tiny.yaml", [*small, "train.policy_ratio=bogus"])
    assert "train.policy_ratio" in str(info.value) and "\n" not in str(info.value)
    cfg = load_config("configs/tiny.yaml", [*small, "train.policy_ratio=sequence"])
    model = DecoderConfig(**{k: getattr(cfg.model.shape(32), k) for k in cfg.model.shape(32).__dataclass_fields__})
    assert train_setup(cfg.train, model, cfg.num_microbatches, 1.0).loss.ratio_level == "sequence"
    with pytest.raises(ValueError, match="train.policy_ratio"):
        LossConfig(ratio_level="bogus")
