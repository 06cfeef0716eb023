"""Microbatch planning: whole groups under a token budget, fixed shapes, exact gradients."""

from __future__ import annotations

import functools

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from conftest import make_decoder_config
from stages.config import LOSS_AGGREGATIONS
from stages.policy import build_stage, hf_named_parameters, hf_state, load_hf_state
from stages.train.batch import PAD_DOC_ID, build_global_batch
from stages.train.loss import LossConfig, grpo_chunked_loss, grpo_microbatch_loss
from stages.train.plan import microbatch_layout, plan_microbatches

LOSS = LossConfig(clip_eps_low=0.2, clip_eps_high=0.28, kl_beta=0.1, temperature=0.9)
# fp32: the same sums taken in another order (other row counts block the matmuls differently).
# Absolute for gradients up to 1; a step of one or two tokens can have entries near 15, and there
# the bound is relative (1e-6 is ~8 fp32 ulps of 1).
_GRAD_TOL = 1e-6


def make_arrays(prompt_len, length, prompt_width: int, max_new_tokens: int, vocab: int = 13,
                seed: int = 0) -> dict[str, np.ndarray]:
    """Stored-rollout arrays with given lengths; log-probs near a near-uniform policy's."""
    rng = np.random.default_rng(seed)
    n = len(prompt_len)
    base = -np.log(vocab)
    return dict(
        prompt_ids=rng.integers(3, vocab, (n, prompt_width)).astype(np.int32),
        prompt_len=np.asarray(prompt_len, np.int32),
        tokens=rng.integers(3, vocab, (n, max_new_tokens)).astype(np.int32),
        length=np.asarray(length, np.int32),
        behav_logp=(base + rng.normal(scale=0.05, size=(n, max_new_tokens))).astype(np.float32),
        ref_logp=(base + rng.normal(scale=0.05, size=(n, max_new_tokens))).astype(np.float32),
        advantage=rng.normal(size=n).astype(np.float32),
    )


@functools.lru_cache(maxsize=None)
def _models():
    """A tiny policy and a copy whose last stage returns hidden states (for the chunked loss)."""
    cfg = make_decoder_config(vocab_size=13, hidden_size=16, intermediate_size=24, num_hidden_layers=2,
                              num_attention_heads=2, num_key_value_heads=1, head_dim=8)
    model = build_stage(cfg)
    model.init_weights(torch.Generator().manual_seed(0), std=0.1)
    hidden = build_stage(cfg, return_hidden=True)
    load_hf_state(hidden, hf_state(model))
    return model, hidden


def _grads(model) -> dict[str, torch.Tensor]:
    return {name: p.grad.clone() for name, p in hf_named_parameters(model)}


def full_batch_grads(model, arrays, mode) -> dict[str, torch.Tensor]:
    """The reference: one padded row per sample, one forward, full logits."""
    batch = build_global_batch(arrays, mode, 0)
    model.zero_grad(set_to_none=True)
    loss, _ = grpo_microbatch_loss(model(batch.input_ids), batch.target, LOSS)
    loss.backward()
    return _grads(model)


def planned_grads(model, batch, num_microbatches: int, chunk_tokens: int = 0) -> dict[str, torch.Tensor]:
    """Sum of per-microbatch gradients, the way the pipeline splits the batch (dim 0)."""
    model.zero_grad(set_to_none=True)
    kwargs = {k: v.chunk(num_microbatches) for k, v in batch.stage_kwargs().items()}
    for m, (ids, tgt) in enumerate(zip(batch.input_ids.chunk(num_microbatches),
                                       batch.target.chunk(num_microbatches))):
        out = model(ids, **{k: v[m] for k, v in kwargs.items()})
        if chunk_tokens:
            loss, _ = grpo_chunked_loss(out, tgt, model.lm_head, LOSS, chunk_tokens)
        else:
            loss, _ = grpo_microbatch_loss(out, tgt, LOSS)
        loss.backward()
    return _grads(model)


def fits_empty_microbatch(seq_lens, layout) -> bool:
    """Independent of the planner: do these sequences fit one empty microbatch, next-fit?"""
    if not layout.packing:
        return len(seq_lens) <= layout.rows
    rows, col = 1, 0
    for n in seq_lens:
        if col + n > layout.seq_len:
            rows, col = rows + 1, 0
        col += n
    return rows <= layout.rows


def check_placement(arrays, batch, layout) -> None:
    """Every sequence sits whole, once, where the plan says; the rest is padding."""
    plan = batch.plan
    covered = np.zeros(batch.input_ids.shape, dtype=bool)
    ids = batch.input_ids.numpy()
    for i in range(len(arrays["length"])):
        p, n = int(arrays["prompt_len"][i]), int(arrays["length"][i])
        r, s = int(plan.row[i]), int(plan.start[i])
        assert r // layout.rows == plan.microbatch[i]
        assert s + p + n <= layout.seq_len
        seq = np.concatenate([arrays["prompt_ids"][i, :p], arrays["tokens"][i, :n]])
        np.testing.assert_array_equal(ids[r, s:s + p + n], seq)
        assert not covered[r, s:s + p + n].any(), f"sample {i} overlaps another"
        covered[r, s:s + p + n] = True
        if layout.packing:
            assert (batch.doc_ids[r, s:s + p + n] == i).all()
            np.testing.assert_array_equal(batch.positions[r, s:s + p + n].numpy(), np.arange(p + n))
    assert (batch.target[..., 1].numpy()[~covered] == 0).all()
    if layout.packing:
        assert (batch.doc_ids.numpy()[~covered] == PAD_DOC_ID).all()


# -- the count rule, by hand -------------------------------------------------------------------
def test_tiny_layout_by_hand():
    # tiny.yaml: 16 prompts x G 8, prompt width 7, 6 new tokens -> S = 13; budget 32 x 13 = 416.
    pad = microbatch_layout(16, 8, 7, 6, 416, packing=False)
    assert (pad.num_microbatches, pad.rows, pad.seq_len) == (4, 32, 13)  # 32 rows = 4 groups
    one_row = microbatch_layout(16, 8, 7, 6, 416, packing=True)
    assert (one_row.num_microbatches, one_row.rows, one_row.seq_len) == (4, 1, 416)  # 416 // 13 = 32 seqs
    rows = microbatch_layout(16, 8, 7, 6, 416, packing=True, pack_row_tokens=52)
    assert (rows.num_microbatches, rows.rows, rows.seq_len) == (4, 8, 52)  # 8 rows x 4 seqs
    # A budget below one worst-case group (52 < 8 x 13): j = 4 sequences per microbatch, a group
    # may open ceil(8 / 4) = 2 microbatches -> 16 x 2.
    small = microbatch_layout(16, 8, 7, 6, 52, packing=False)
    assert (small.num_microbatches, small.rows) == (32, 4)
    # 48 samples per microbatch = 6 groups: ceil(16 / 6) = 3 microbatches, the last one part empty.
    assert microbatch_layout(16, 8, 7, 6, 48 * 13, packing=False).num_microbatches == 3


def test_impossible_budgets_name_the_key():
    with pytest.raises(ValueError, match=r"max_tokens_per_microbatch=12 .* at least 13"):
        microbatch_layout(16, 8, 7, 6, 12, packing=False)
    with pytest.raises(ValueError, match="pack_row_tokens=500"):
        microbatch_layout(16, 8, 7, 6, 416, packing=True, pack_row_tokens=500)
    layout = microbatch_layout(2, 2, 3, 2, 10, packing=True)
    with pytest.raises(ValueError, match="layout was made for 2 groups x 2 = 4"):
        plan_microbatches(np.array([3, 3, 3]), layout)
    with pytest.raises(ValueError, match=r"\[1, 5\]"):
        plan_microbatches(np.array([3, 3, 3, 6]), layout)


def test_groups_stay_whole_and_split_only_when_alone_too_big():
    layout = microbatch_layout(3, 4, 3, 3, 12, packing=True)  # S = 6, one row of 12 -> j = 2, k = 0
    assert layout.num_microbatches == 3 * 2
    # group 0 fits (4 x 3 = 12); group 1 does not (4 x 6 = 24): split; group 2 fits again (4 x 2).
    plan = plan_microbatches(np.array([3, 3, 3, 3, 6, 6, 6, 6, 2, 2, 2, 2]), layout)
    assert plan.split_groups == (1,)
    assert plan.microbatch.tolist() == [0, 0, 0, 0, 1, 1, 2, 2, 3, 3, 3, 3]
    assert plan.num_used == 4 <= layout.num_microbatches


# -- fixed shapes over steps whose lengths differ ----------------------------------------------
LENGTH_DISTRIBUTIONS = {
    "all-short": lambda rng, n, gw: np.ones(n, int),
    "all-max": lambda rng, n, gw: np.full(n, gw),
    "uniform": lambda rng, n, gw: rng.integers(0, gw + 1, n),
    "bimodal": lambda rng, n, gw: np.where(rng.random(n) < 0.5, 1, gw),
    "one-long-group": lambda rng, n, gw: np.r_[np.full(8, gw), np.full(n - 8, 2)],
}


@pytest.mark.parametrize("packing,row_tokens", [(False, None), (True, None), (True, 52)])
def test_every_step_has_the_same_shapes(packing, row_tokens):
    layout = microbatch_layout(16, 8, 7, 6, 416, packing=packing, pack_row_tokens=row_tokens)
    rng = np.random.default_rng(0)
    shapes = set()
    for name, lengths in LENGTH_DISTRIBUTIONS.items():
        arrays = make_arrays(rng.integers(5, 8, 128), lengths(rng, 128, 6), 7, 6, seed=len(shapes))
        batch = build_global_batch(arrays, "token-mean", 0, layout)
        check_placement(arrays, batch, layout)
        assert batch.plan.split_groups == ()
        shapes.add((tuple(batch.input_ids.shape), tuple(batch.target.shape),
                    tuple((k, tuple(v.shape)) for k, v in batch.stage_kwargs().items())))
    assert len(shapes) == 1, shapes
    assert next(iter(shapes))[0] == (layout.total_rows, layout.seq_len)


def test_completion_values_map_back_to_store_order():
    arrays = make_arrays([2, 3, 1, 4, 2, 2], [3, 0, 2, 1, 2, 3], 4, 3)
    for layout in (None, microbatch_layout(3, 2, 4, 3, 14, packing=True),
                   microbatch_layout(3, 2, 4, 3, 14, packing=False)):
        batch = build_global_batch(arrays, "token-mean", 0, layout)
        # Put each position's own next-token id there: mapping back must give the stored tokens.
        got = batch.completion_values(batch.target[..., 0])
        mask = np.arange(3)[None, :] < arrays["length"][:, None]
        np.testing.assert_array_equal(got, np.where(mask, arrays["tokens"], 0))


# -- the property: planned microbatches give the full-batch gradient ---------------------------
@st.composite
def _steps(draw):
    num_groups, G = draw(st.integers(1, 5)), draw(st.integers(1, 6))
    Pw, Gw = draw(st.integers(1, 5)), draw(st.integers(1, 5))
    n = num_groups * G
    S = Pw + Gw
    budget = draw(st.integers(S, 3 * G * S))  # below and above one worst-case group
    packing = draw(st.sampled_from([True, False]))
    row_tokens = draw(st.one_of(st.none(), st.integers(S, budget))) if packing else None
    return dict(
        num_groups=num_groups, G=G, Pw=Pw, Gw=Gw, budget=budget, packing=packing, row_tokens=row_tokens,
        prompt_len=draw(st.lists(st.integers(1, Pw), min_size=n, max_size=n)),
        length=draw(st.lists(st.integers(0, Gw), min_size=n, max_size=n)),
        mode=draw(st.sampled_from(LOSS_AGGREGATIONS)),
        chunk_tokens=draw(st.sampled_from([0, 0, 1, 3, 64])),  # 0: full logits
        seed=draw(st.integers(0, 2**16)),
    )


@settings(max_examples=100, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(step=_steps())
def test_planned_microbatch_gradients_equal_the_full_batch_gradient(step):
    model, hidden_model = _models()
    arrays = make_arrays(step["prompt_len"], step["length"], step["Pw"], step["Gw"], seed=step["seed"])
    layout = microbatch_layout(step["num_groups"], step["G"], step["Pw"], step["Gw"], step["budget"],
                               step["packing"], step["row_tokens"])
    batch = build_global_batch(arrays, step["mode"], 0, layout)
    assert tuple(batch.input_ids.shape) == (layout.total_rows, layout.seq_len)
    plan = batch.plan
    assert plan.num_used <= layout.num_microbatches
    check_placement(arrays, batch, layout)
    seq = np.asarray(step["prompt_len"]) + np.asarray(step["length"])
    G = step["G"]
    for g in range(step["num_groups"]):
        parts = set(plan.microbatch[g * G:(g + 1) * G].tolist())
        assert (len(parts) > 1) == (g in plan.split_groups)
        if len(parts) > 1:
            assert not fits_empty_microbatch(seq[g * G:(g + 1) * G], layout), f"group {g} split needlessly"

    event(f"{'packing' if layout.packing else 'padding'}, "
          f"{'a group split' if plan.split_groups else 'groups whole'}, "
          f"{'chunked' if step['chunk_tokens'] else 'full'} log-probs")
    expected = full_batch_grads(model, arrays, step["mode"])
    chunk = step["chunk_tokens"]
    got = planned_grads(hidden_model if chunk else model, batch, layout.num_microbatches, chunk)
    worst = max((got[n] - expected[n]).abs().max().item() for n in expected)
    scale = max(g.abs().max().item() for g in expected.values())
    assert worst <= _GRAD_TOL * max(1.0, scale), f"max abs gradient difference {worst:.2e} (max |g| {scale:.2f})"
    assert batch.num_tokens == 0 or scale > 1e-4  # a gradient worth comparing


def test_data_parallel_replicas_take_equal_counts():
    # 16 groups, 6 per microbatch -> 3, rounded up to 4 for 2 replicas (2 each; the last one empty).
    layout = microbatch_layout(16, 8, 7, 6, 48 * 13, packing=False, data_parallel_size=2)
    assert layout.num_microbatches == 4


# -- through the pipeline: five steps whose lengths differ, one fixed shape ----------------------
@pytest.mark.parametrize("packing,row_tokens,chunk_tokens", [(False, None, None), (True, 22, 7)])
def test_five_steps_of_different_lengths_through_a_pp2_pipeline(packing, row_tokens, chunk_tokens):
    from conftest import make_model
    from stages.train.engine import TrainSetup
    from stages.train.local import run_local_pipeline
    from stages.train.loss import token_logp

    cfg = make_decoder_config()
    model = make_model(cfg, std=0.1)
    num_groups, G, Pw, Gw = 4, 4, 5, 6
    layout = microbatch_layout(num_groups, G, Pw, Gw, 2 * G * (Pw + Gw), packing, row_tokens)
    rng = np.random.default_rng(1)
    arrays = [make_arrays(rng.integers(2, Pw + 1, 16), lengths(rng, 16, Gw), Pw, Gw, vocab=cfg.vocab_size, seed=i)
              for i, lengths in enumerate(LENGTH_DISTRIBUTIONS.values())]
    batches = [build_global_batch(a, "seq-mean-token-mean", 0, layout) for a in arrays]
    calls = ["grad"] + ["train"] * len(batches) + ["reference"]
    setup = TrainSetup(model=cfg, pipeline_parallel_size=2, num_microbatches=layout.num_microbatches,
                       loss=LOSS, logprob_chunk_tokens=chunk_tokens, timeout_s=60)
    outputs = run_local_pipeline(setup, hf_state(model), [batches[2], *batches, batches[2]], calls=calls)

    got = {}
    for out in outputs:
        assert out.errors == [None] * len(calls), out.errors
        got.update(out.grads[0])
    expected = full_batch_grads(model, arrays[2], "seq-mean-token-mean")
    worst = max((got[n] - expected[n]).abs().max().item() for n in expected)
    assert worst <= _GRAD_TOL, f"max abs gradient difference {worst:.2e}"
    last = outputs[-1]  # holds the last stage: the loss of every one of the five steps
    assert all(np.isfinite(s.metrics["loss"]) for s in last.steps[1:1 + len(batches)])
    # The frozen reference's log-probs, mapped back to store order, match an unplanned forward.
    unplanned = build_global_batch(arrays[2], "token-mean", 0)
    with torch.no_grad():
        want = unplanned.completion_values(token_logp(model(unplanned.input_ids), unplanned.target[..., 0], 0.9))
    logp = next(out.logps[-1] for out in outputs if out.logps[-1] is not None)
    np.testing.assert_allclose(batches[2].completion_values(logp), want, atol=1e-5)
