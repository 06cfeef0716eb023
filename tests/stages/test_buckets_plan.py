"""Length-bucket planning: passes worked out by hand, placement invariants over random steps, the
schedule's microbatch count per pass, and exact gradients accumulated over passes in one process."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from conftest import make_decoder_config, make_model
from stages.config import LOSS_AGGREGATIONS
from stages.policy import hf_named_parameters
from stages.train.batch import build_global_batch
from stages.train.buckets import bucketed_layout, microbatches_per_pass, plan_passes, power_of_two_widths
from stages.train.loss import LossConfig, grpo_microbatch_loss, token_logp
from stages.train.plan import microbatch_layout

LOSS = LossConfig(clip_eps_low=0.2, clip_eps_high=0.28, kl_beta=0.1, temperature=0.9)


def test_passes_by_hand():
    # S = 5 + 6 = 11, B = 48: bucket 6 holds [8, 6] microbatches, bucket 11 [4, 11]; m = 2, D = 1.
    layout = bucketed_layout(5, 4, 5, 6, 48, (6,), packing=False, microbatches=2)
    assert [(b.rows, b.seq_len) for b in layout.buckets] == [(8, 6), (4, 11)]
    seq = np.array([[3, 4, 5, 6], [11, 2, 2, 2], [6, 6, 6, 6], [2, 3, 4, 5], [5, 5, 5, 5]])
    plan = plan_passes(seq.reshape(-1), layout)
    # Widest first: g1 alone in bucket 11 opens a pass of 2 microbatches; g0 (home bucket 6) fills
    # its empty second microbatch (rows 4..7). g2, g3, g4 fill 1.5 microbatches of bucket 6: a pass.
    assert plan.pass_bucket == (1, 0)
    assert plan.sample_pass.reshape(5, 4)[:, 0].tolist() == [0, 0, 1, 1, 1]
    assert plan.row.reshape(5, 4).tolist() == [[4, 5, 6, 7], [0, 1, 2, 3], [0, 1, 2, 3], [4, 5, 6, 7],
                                               [8, 9, 10, 11]]
    assert (plan.start == 0).all()
    assert plan.num_slots == 2 * 44 + 2 * 48 == 184
    assert plan.slots_per_real_token == pytest.approx(184 / 93)
    fixed = microbatch_layout(5, 4, 5, 6, 48, packing=False)  # today: 5 microbatches of [4, 11]
    assert fixed.num_microbatches * fixed.tokens_per_microbatch == 220
    # All five groups in bucket 11 would take 5 microbatches = 3 passes = 264 slots: not chosen.


def test_a_bucket_holding_a_fraction_of_a_pass_moves_up():
    # One short group alone would cost a whole pass of bucket 6 (96 slots); in bucket 11 it fills
    # the free microbatch of the long groups' last pass.
    layout = bucketed_layout(3, 4, 5, 6, 48, (6,), packing=False, microbatches=2)
    plan = plan_passes(np.array([11, 3, 3, 3, 10, 9, 3, 3, 3, 3, 3, 3]), layout)
    assert plan.pass_bucket == (1, 1) and plan.num_slots == 4 * 44


def test_groups_split_where_that_saves_microbatches():
    # Rows of 8 slots, 6 to a microbatch; three groups of four 5-token sequences. Whole groups take
    # one microbatch each (3 x 48 slots); split, g1 fills the last two rows of the first microbatch
    # and goes on in the second: 2 x 48 slots.
    layout = bucketed_layout(3, 4, 5, 6, 48, (8,), packing=False, microbatches=1, max_microbatches=None)
    plan = plan_passes(np.full(12, 5), layout)
    assert plan.pass_bucket == (0,) and plan.pass_microbatches == (2,) and plan.num_slots == 96
    assert plan.row.tolist() == list(range(12)) and plan.split_groups == (1,)
    # Packed rows of 11, 2 to a microbatch, groups [7, 11], [4, 10], [8, 2]. Whole groups take 3
    # microbatches (g1's 10 does not fit beside g0, g2's 8 not beside g1). Longest first into the
    # first row with room: 11 r0, 10 r1, 8 r2, 7 r3, 4 after the 7, 2 after the 8: 4 rows, 2
    # microbatches, with g0 and g1 split across them.
    packed = plan_passes(np.array([7, 11, 4, 10, 8, 2]),
                         bucketed_layout(3, 2, 5, 6, 22, (), packing=True, microbatches=1, max_microbatches=None))
    assert packed.num_slots == 2 * 22 and packed.split_groups == (0, 1)
    assert packed.row.tolist() == [3, 0, 3, 1, 2, 2] and packed.start.tolist() == [0, 0, 7, 0, 0, 8]
    # Where splitting saves nothing, groups stay whole: two groups in a pass of 2 microbatches fill
    # 2 x [4, 11] exactly (88 slots; in 2 x [6, 8], split or not, they would take 96).
    whole = plan_passes(np.full(8, 5), bucketed_layout(2, 4, 5, 6, 48, (8,), False, 2))
    assert whole.split_groups == () and whole.pass_bucket == (1,) and whole.num_slots == 88


def test_microbatches_per_pass_vary_by_hand():
    # Five groups of four 11-token sequences: one group per [4, 11] microbatch, 5 microbatches.
    seq = np.full(20, 11)
    rule = ("1f1b", 2, 1)
    fixed = plan_passes(seq, bucketed_layout(5, 4, 5, 6, 48, (6,), False, 2, schedule=rule))
    assert fixed.pass_microbatches == (2, 2, 2) and fixed.num_slots == 6 * 44  # the last pass half empty
    one = plan_passes(seq, bucketed_layout(5, 4, 5, 6, 48, (6,), False, 2, max_microbatches=None, schedule=rule))
    assert one.pass_bucket == (1,) and one.pass_microbatches == (5,) and one.num_slots == 5 * 44
    assert one.sample_pass.tolist() == [0] * 20 and one.row.tolist() == list(range(20))
    capped = plan_passes(seq, bucketed_layout(5, 4, 5, 6, 48, (6,), False, 2, max_microbatches=3, schedule=rule))
    assert capped.pass_microbatches == (3, 2) and capped.num_slots == 5 * 44
    assert capped.sample_pass.tolist() == [0] * 12 + [1] * 8
    assert capped.row.tolist() == list(range(12)) + list(range(8))
    # A pass never holds fewer microbatches than the schedule runs: one group still gets m = 2; with
    # data parallelism every pass splits into D equal blocks.
    alone = plan_passes(np.full(4, 11), bucketed_layout(1, 4, 5, 6, 48, (6,), False, 2, max_microbatches=None,
                                                        schedule=rule))
    assert alone.pass_microbatches == (2,)
    dp = plan_passes(seq, bucketed_layout(5, 4, 5, 6, 48, (6,), False, 2, 2, None, rule))
    assert dp.pass_microbatches == (6,)  # 5 needed -> 3 per data-parallel rank


def test_a_cap_the_schedule_cannot_run_is_refused():
    with pytest.raises(ValueError, match=r"train.max_microbatches_per_pass=5 must be .*interleaved-1f1b"):
        bucketed_layout(5, 4, 5, 6, 48, (6,), False, 2, max_microbatches=5, schedule=("interleaved-1f1b", 2, 2))
    with pytest.raises(ValueError, match=r"train.max_microbatches_per_pass=1 must be"):
        bucketed_layout(5, 4, 5, 6, 48, (6,), False, 2, max_microbatches=1, schedule=("1f1b", 2, 1))


@pytest.mark.parametrize("schedule, pp, virtual, m", [
    ("gpipe", 2, 1, 2), ("1f1b", 4, 1, 4), ("interleaved-1f1b", 4, 2, 4), ("zb-h1", 3, 1, 3),
    ("zbv", 2, 2, 2), ("dualpipev", 2, 2, 4), ("dualpipev", 3, 2, 6),
])
def test_microbatches_per_pass_is_the_smallest_the_schedule_runs(schedule, pp, virtual, m):
    assert microbatches_per_pass(schedule, pp, virtual) == m


def test_packed_rows_wider_than_s_hold_several_sequences_by_hand():
    # S = 5 + 6 = 11, B = 44, width 22 = 2S: rows of [4, 11] and [2, 22]; 12 sequences of 6 tokens.
    layout = bucketed_layout(3, 4, 5, 6, 44, (22,), packing=True, microbatches=2)
    assert [(b.rows, b.seq_len, b.max_seq_len) for b in layout.buckets] == [(4, 11, 11), (2, 22, 11)]
    assert layout.max_seq_len == 11
    seq = np.full(12, 6)
    plan = plan_passes(seq, layout)
    # 11-wide rows hold one sequence each: 12 rows, 3 microbatches, two passes of m = 2 (176 slots).
    # 22-wide rows hold three: 4 rows, 2 microbatches, one pass (88 slots).
    assert plan.pass_bucket == (1,) and plan.pass_microbatches == (2,) and plan.num_slots == 88
    assert sorted(plan.start.tolist()) == [0] * 4 + [6] * 4 + [12] * 4
    padded = bucketed_layout(3, 4, 5, 6, 44, (22,), packing=False, microbatches=2)
    assert padded.widths == (11,)  # a padded row holds one sequence: wider rows are dropped
    assert plan_passes(seq, padded).num_slots == 176
    assert bucketed_layout(3, 4, 5, 6, 21, (22,), packing=True, microbatches=2).widths == (11,)  # over the budget


def test_power_of_two_widths():
    assert power_of_two_widths(71) == (8, 16, 32, 64, 71)
    assert power_of_two_widths(13) == (8, 13)


@pytest.mark.parametrize("seed", range(6))
def test_every_sample_has_its_own_slots_in_a_wide_enough_row(seed):
    rng = np.random.default_rng(seed)
    G, groups, Pw, new = int(rng.integers(1, 6)), int(rng.integers(1, 12)), 4, int(rng.integers(2, 20))
    S = Pw + new
    packing, m, D = bool(rng.integers(2)), int(rng.integers(1, 4)), int(rng.integers(1, 3))
    widths = sorted(set(rng.integers(2, 2 * S + 1, 3).tolist()))  # packed, those above S are wide rows
    layout = bucketed_layout(groups, G, Pw, new, int(rng.integers(S, 4 * S)), widths, packing, m, D)
    seq = rng.integers(1, S + 1, groups * G)
    plan = plan_passes(seq, layout)
    assert plan_passes(seq, layout).pass_bucket == plan.pass_bucket  # deterministic: every rank agrees
    used: set[tuple[int, int, int]] = set()
    for i in range(len(seq)):
        bucket = layout.buckets[plan.pass_bucket[plan.sample_pass[i]]]
        assert 0 <= plan.row[i] < bucket.total_rows and plan.start[i] + seq[i] <= bucket.seq_len
        assert seq[i] <= bucket.max_seq_len <= S
        assert packing or plan.start[i] == 0
        cells = {(int(plan.sample_pass[i]), int(plan.row[i]), c) for c in range(plan.start[i], plan.start[i] + seq[i])}
        assert not cells & used
        used |= cells
    for g in range(groups):  # a group in one pass, in one microbatch unless it was split
        idx = np.arange(g * G, (g + 1) * G)
        assert len(set(plan.sample_pass[idx])) == 1 or g in plan.split_groups
        rows = layout.buckets[plan.pass_bucket[plan.sample_pass[idx[0]]]].rows
        assert len(set(plan.row[idx] // rows)) == 1 or g in plan.split_groups
    assert plan.num_slots >= seq.sum()


@pytest.mark.parametrize("packing", [False, True])
def test_gradient_accumulated_over_passes_equals_full_batch(packing):
    """In one process: the sum of every pass's microbatch losses has the full-batch gradient, and
    the per-pass log-probs map back to store order."""
    model = make_model(make_decoder_config())
    rng = np.random.default_rng(3)
    n, Pw, new = 24, 5, 6
    prompt_len, length = rng.integers(1, Pw + 1, n), rng.integers(1, new + 1, n)
    length[:4] = new  # one group of long sequences, the rest mixed
    arrays = dict(prompt_ids=rng.integers(3, 17, (n, Pw)), prompt_len=prompt_len,
                  tokens=rng.integers(3, 17, (n, new)), length=length,
                  behav_logp=rng.normal(-2.8, 0.1, (n, new)).astype(np.float32),
                  ref_logp=rng.normal(-2.8, 0.1, (n, new)).astype(np.float32),
                  advantage=rng.normal(size=n).astype(np.float32))
    layout = bucketed_layout(6, 4, Pw, new, 24, (4, 8), packing, microbatches=2)
    for mode in LOSS_AGGREGATIONS:
        full = build_global_batch(arrays, mode, 0)
        model.zero_grad(set_to_none=True)
        grpo_microbatch_loss(model(full.input_ids), full.target, LOSS)[0].backward()
        want = {k: p.grad.clone() for k, p in hf_named_parameters(model)}
        batch = build_global_batch(arrays, mode, 0, layout)
        assert batch.plan.num_passes >= 2
        model.zero_grad(set_to_none=True)
        for p in batch.passes:
            kw = {k: v.chunk(p.num_microbatches) for k, v in p.stage_kwargs().items()}
            for j, (ids, tgt) in enumerate(zip(p.input_ids.chunk(p.num_microbatches),
                                               p.target.chunk(p.num_microbatches))):
                out = model(ids, **{k: v[j] for k, v in kw.items()})
                grpo_microbatch_loss(out, tgt, LOSS)[0].backward()
        for k, p in hf_named_parameters(model):
            torch.testing.assert_close(p.grad, want[k], rtol=0, atol=1e-6)
    with torch.no_grad():
        want = full.completion_values(token_logp(model(full.input_ids), full.target[..., 0].long(), 1.0))
        got = batch.completion_values([token_logp(model(p.input_ids, **p.stage_kwargs()), p.target[..., 0].long(), 1.0)
                                       for p in batch.passes])
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-5)


@pytest.mark.parametrize("samples_per_microbatch, bound", [(64, 1.3), (8, 1.2)])
def test_tiny_config_slots_per_real_token(samples_per_microbatch, bound):
    """configs/tiny.yaml (64 prompts x G 8, S = 7 + 6, 1F1B on 2 ranks: m = 2) on addition lengths:
    the right answer for 70% of samples, any length for the rest. At the config's budget (64 x 13)
    one pass is 2 x 832 slots, a third of the step: whole passes bound the gain; a budget of 8 x 13
    lets the buckets cut the padding."""
    from stages.tasks.addition import make_prompts

    rng = np.random.default_rng(0)
    prompts = make_prompts(0, 0, 64, 2)
    prompt_len = np.repeat([1 + len(p) for p in prompts], 8)
    answer = np.repeat([len(str(sum(map(int, p[:-1].split("+"))))) + 1 for p in prompts], 8)
    length = np.where(rng.random(512) < 0.3, rng.integers(1, 7, 512), answer)
    budget = samples_per_microbatch * 13
    layout = bucketed_layout(64, 8, 7, 6, budget, (10, 12), packing=False, microbatches=2)
    plan = plan_passes(prompt_len + length, layout)
    fixed = microbatch_layout(64, 8, 7, 6, budget, packing=False)
    fixed_ratio = fixed.num_microbatches * fixed.tokens_per_microbatch / (prompt_len + length).sum()
    assert fixed_ratio == pytest.approx(1.2695, abs=1e-4)  # today's single layout, either budget
    assert plan.slots_per_real_token <= bound


def test_config_key_gives_the_bucketed_layout():
    from flows.config import load_config
    from stages.config import ConfigError

    cfg = load_config("configs/tiny.yaml", ["train.length_buckets=[10,12]", "train.schedule=dualpipev",
                                            "train.virtual_pipeline_model_parallel_size=2"])
    layout = cfg.microbatch_layout
    assert layout.widths == (10, 12, 13) and [b.rows for b in layout.buckets] == [83, 69, 64]
    assert cfg.num_microbatches == 4  # DualPipeV on 2 ranks: m >= 2p
    with pytest.raises(ConfigError, match="train.length_buckets"):
        load_config("configs/tiny.yaml", ["train.length_buckets=[1,12]"])
