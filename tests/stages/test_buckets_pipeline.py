"""Length-bucketed steps through the pipeline: on every schedule, a step of several passes of mixed
bucket shapes, with a pass count that changes from step to step, computes the single-process
full-batch gradient, and the forward-only passes the full model's log-probs in store order. The
same holds when the microbatch count of a pass varies too (one pass per bucket, or a cap).

One set of rank processes per case runs every call (process start-up is the cost here).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from conftest import make_decoder_config, make_model
from stages.policy import hf_named_parameters, hf_state
from stages.train.batch import BucketedBatch, build_global_batch
from stages.train.buckets import bucketed_layout, microbatches_per_pass, valid_microbatches
from stages.train.engine import TrainSetup
from stages.train.local import run_local_pipeline
from stages.train.loss import LossConfig, grpo_microbatch_loss, token_logp

LOSS = LossConfig(clip_eps_low=0.2, clip_eps_high=0.28, kl_beta=0.1, temperature=0.9)
G, PROMPT_WIDTH, MAX_NEW = 4, 5, 6  # S = 11
WIDTHS = (6, 8)  # buckets of 6, 8 and 11 tokens
BUDGET = 48  # microbatches of [8, 6], [6, 8] and [4, 11]
# Sequence lengths (prompt + completion) per group: step A has groups in every bucket, step B is
# long-tailed (more passes, all but one of the widest bucket).
STEP_A = [[3, 4, 5, 6], [7, 5, 8, 3], [11, 4, 4, 5], [3, 3, 4, 6], [6, 9, 4, 4], [5, 5, 5, 5], [9, 11, 3, 3],
          [2, 6, 6, 3], [4, 4, 4, 4], [6, 2, 2, 5]]
STEP_B = [[11, 10, 3, 4], [9, 11, 11, 11], [4, 4, 4, 11], [10, 3, 7, 11], [8, 8, 8, 8], [11, 11, 11, 3],
          [11, 2, 2, 2], [5, 11, 5, 5], [11, 11, 11, 11], [3, 3, 10, 11]]
CALLS = ["grad", "grad", "reference", "proximal", "train"]


def arrays_for(model, seq_lens: list[list[int]], seed: int) -> dict[str, np.ndarray]:
    """Stored-rollout arrays with the given sequence lengths; behaviour and reference log-probs are
    the model's own plus noise (ratios near 1, a small KL)."""
    rng = np.random.default_rng(seed)
    s = np.asarray(seq_lens, np.int64).reshape(-1)
    n, vocab = len(s), model.cfg.vocab_size
    prompt_len = np.clip(rng.integers(2, PROMPT_WIDTH + 1, n), s - MAX_NEW, s - 1)
    length = s - prompt_len
    arrays = dict(prompt_ids=rng.integers(3, vocab, (n, PROMPT_WIDTH)).astype(np.int32),
                  prompt_len=prompt_len.astype(np.int32),
                  tokens=rng.integers(3, vocab, (n, MAX_NEW)).astype(np.int32), length=length.astype(np.int32),
                  behav_logp=np.zeros((n, MAX_NEW), np.float32), ref_logp=np.zeros((n, MAX_NEW), np.float32),
                  advantage=rng.normal(size=n).astype(np.float32))
    own = single_process_logp(model, arrays)
    for key in ("behav_logp", "ref_logp"):
        arrays[key] = np.where(own != 0, own + rng.normal(scale=0.05, size=own.shape), 0).astype(np.float32)
    return arrays


def single_process_logp(model, arrays) -> np.ndarray:
    """[N, max_new] completion log-probs of the whole model, one padded row per sample."""
    batch = build_global_batch(arrays, "token-mean", 0)
    with torch.no_grad():
        logp = token_logp(model(batch.input_ids), batch.target[..., 0].long(), LOSS.temperature)
    return batch.completion_values(logp)


def full_batch_grads(model, arrays, mode: str) -> dict[str, torch.Tensor]:
    batch = build_global_batch(arrays, mode, 0)
    model.zero_grad(set_to_none=True)
    loss, _ = grpo_microbatch_loss(model(batch.input_ids), batch.target, LOSS)
    loss.backward()
    return {name: p.grad.clone() for name, p in hf_named_parameters(model)}


def merged(outputs, call: int, atol: float) -> dict[str, torch.Tensor]:
    got: dict[str, torch.Tensor] = {}
    for out in outputs:
        assert out.errors[call] is None, out.errors[call]
        for name, g in out.grads[call].items():
            if name in got:  # copies on several ranks (tied embedding, DP / TP replicas) agree
                torch.testing.assert_close(got[name], g, rtol=0, atol=atol)
            got[name] = g
    return got


def worst_diff(got, want) -> float:
    assert set(got) == set(want)
    return max((got[n] - want[n]).abs().max().item() for n in want)


@pytest.mark.parametrize("schedule, virtual, dp, tp, tied, packing", [
    ("gpipe", 1, 1, 1, False, False),
    ("1f1b", 1, 1, 1, True, True),
    ("interleaved-1f1b", 2, 1, 1, True, False),
    ("zb-h1", 1, 1, 1, False, True),
    ("zbv", 2, 1, 1, True, False),
    ("dualpipev", 2, 1, 1, False, False),
    ("1f1b", 1, 2, 1, True, False),  # PP2 x DP2
    ("1f1b", 1, 1, 2, False, False),  # PP2 x TP2
])
def test_bucketed_steps_equal_single_process(schedule, virtual, dp, tp, tied, packing):
    cfg = make_decoder_config(tie_word_embeddings=tied)
    model = make_model(cfg)
    m = microbatches_per_pass(schedule, 2, virtual)
    layout = bucketed_layout(len(STEP_A), G, PROMPT_WIDTH, MAX_NEW, BUDGET, WIDTHS, packing, m, dp)
    a, b = arrays_for(model, STEP_A, seed=1), arrays_for(model, STEP_B, seed=2)
    modes = ("token-mean", "seq-mean-token-mean")
    step_a, step_b = build_global_batch(a, modes[0], 0, layout), build_global_batch(b, modes[1], 0, layout)
    assert isinstance(step_a, BucketedBatch) and isinstance(step_b, BucketedBatch)
    buckets_a, buckets_b = step_a.plan.pass_bucket, step_b.plan.pass_bucket
    # Passes of mixed shapes in one step. Packed, the planner puts these steps in the widest bucket
    # (narrow packed rows save no slots here), so those cases check a varying count of packed passes.
    assert len(set(buckets_a)) >= (1 if packing else 2), buckets_a
    assert len(buckets_a) != len(buckets_b), (buckets_a, buckets_b)  # the pass count varies
    # Packed, the planner lets groups split (it saves slots here).
    assert bool(step_a.plan.split_groups and step_b.plan.split_groups) == packing
    expected = [full_batch_grads(model, a, modes[0]), full_batch_grads(model, b, modes[1])]
    norm = torch.cat([g.reshape(-1) for g in expected[0].values()]).norm().item()
    setup = TrainSetup(model=cfg, pipeline_parallel_size=2, num_microbatches=m, schedule=schedule,
                       virtual_stages=virtual, data_parallel_size=dp, tensor_parallel_size=tp, loss=LOSS,
                       max_grad_norm=norm / 2, timeout_s=60)
    # The same steps with a varying microbatch count per pass: one pass per bucket, and a cap that
    # splits a bucket into passes of different counts.
    rule = (schedule, 2, virtual)
    per_bucket = bucketed_layout(len(STEP_A), G, PROMPT_WIDTH, MAX_NEW, BUDGET, WIDTHS, packing, m, dp, None, rule)
    capped = bucketed_layout(len(STEP_A), G, PROMPT_WIDTH, MAX_NEW, BUDGET, WIDTHS, packing, m, dp,
                             valid_microbatches(m + 1, m, *rule), rule)
    varying = [build_global_batch(a, modes[0], 0, per_bucket), build_global_batch(b, modes[1], 0, per_bucket),
               build_global_batch(b, modes[1], 0, capped)]
    counts = [step.plan.pass_microbatches for step in varying]
    assert len({n for c in counts for n in c}) >= 2, counts  # passes of different microbatch counts
    assert len({len(c) for c in counts}) >= 2, counts  # and a varying pass count
    assert len(varying[0].passes) <= len(buckets_a)  # never more passes than fixed-count ones
    # Calls: grad A, grad B, reference B, proximal B, grad of each varying step, train A (the last:
    # it steps the weights).
    outputs = run_local_pipeline(setup, hf_state(model), [step_a, step_b, step_b, step_b, *varying, step_a],
                                 calls=[*CALLS[:4], "grad", "grad", "grad", "train"])
    tol = 1e-5 if tp > 1 else 1e-6
    for call, want in zip((0, 1, 4, 5, 6), (*expected, expected[0], expected[1], expected[1])):
        worst = worst_diff(merged(outputs, call, tol), want)
        assert worst <= tol, f"{schedule} dp={dp} tp={tp} call {call}: max abs gradient difference {worst:.2e}"
    assert max(g.abs().max().item() for g in expected[0].values()) > 1e-3  # a gradient worth comparing
    clipped = {n: g * (norm / 2) / (norm + 1e-6) for n, g in expected[0].items()}
    assert worst_diff(merged(outputs, 7, tol), clipped) <= tol  # the step clipped by the global norm
    want_logp = torch.from_numpy(single_process_logp(model, b))
    for call in (2, 3):  # reference and proximal (weights not yet stepped): the same model
        got = [out.logps[call] for out in outputs if out.logps[call] is not None]
        assert len(got) == 1
        # fp32 log-probs near -1 from microbatches of other shapes than the single process's: the
        # matmuls block them differently, a few ulps (1.4e-6 on a Zen 3 without AVX-512).
        torch.testing.assert_close(got[0], want_logp, rtol=1e-5, atol=1e-4 if tp > 1 else 1e-6)
    for out in outputs:
        metrics = out.steps[0].metrics
        assert metrics["train_passes"] == len(buckets_a)
        assert metrics["train_token_slots_per_real_token"] == pytest.approx(step_a.plan.slots_per_real_token)
        stages = {act.stage for act in out.steps[0].actions}
        for s in stages:  # every pass ran its m forwards per stage
            assert [act.kind for act in out.steps[0].actions if act.stage == s].count("F") == m * len(buckets_a)
            forwards = [act.kind for act in out.steps[5].actions if act.stage == s].count("F")
            assert forwards == sum(counts[1]) // dp
        assert out.steps[6].metrics["train_passes"] == len(counts[2])


def test_ranks_disagreeing_on_the_passes_fail_together_and_recover():
    """Rank 1 drops a step's last pass: every rank raises the same mismatch naming the pass count,
    before any pipeline runs, and the next step trains."""
    from stages.train.faults import InjectedFault

    cfg = make_decoder_config()
    model = make_model(cfg)
    layout = bucketed_layout(len(STEP_A), G, PROMPT_WIDTH, MAX_NEW, BUDGET, WIDTHS, False, 2)
    step = build_global_batch(arrays_for(model, STEP_A, seed=1), "token-mean", 0, layout)
    assert len(step.passes) >= 2
    setup = TrainSetup(model=cfg, pipeline_parallel_size=2, num_microbatches=2, schedule="1f1b", loss=LOSS,
                       timeout_s=30, faults=(InjectedFault(rank=1, kind="passes", step=0),))
    outputs = run_local_pipeline(setup, hf_state(model), [step, step], calls=["grad", "grad"], stop_on_error=False)
    for out in outputs:
        assert out.errors[0] is not None and out.errors[0].startswith("InputMismatchError"), out.errors[0]
        assert f"rank 1 has num_passes={len(step.passes) - 1}" in out.errors[0]
        assert out.errors[1] is None
    want = full_batch_grads(model, arrays_for(model, STEP_A, seed=1), "token-mean")
    assert worst_diff(merged(outputs, 1, 1e-6), want) <= 1e-6


@pytest.mark.parametrize("schedule, virtual", [("1f1b", 1), ("zbv", 2)])
def test_a_known_microbatch_shape_skips_the_inference_bit_for_bit(schedule, virtual):
    """With one pass per bucket, step B's widest-bucket pass has 10 microbatches and step A's 4: a
    schedule of A built after B's takes B's tensor shapes instead of torch's inference, and gives
    the gradients and log-probs of a schedule whose shapes were inferred, bit for bit."""
    cfg = make_decoder_config()
    model = make_model(cfg)
    m = microbatches_per_pass(schedule, 2, virtual)
    layout = bucketed_layout(len(STEP_A), G, PROMPT_WIDTH, MAX_NEW, BUDGET, WIDTHS, False, m, 1, None,
                             (schedule, 2, virtual))
    a = build_global_batch(arrays_for(model, STEP_A, seed=1), "token-mean", 0, layout)
    b = build_global_batch(arrays_for(model, STEP_B, seed=2), "token-mean", 0, layout)
    widest = len(layout.buckets) - 1
    assert a.plan.pass_bucket == (widest, 0) and b.plan.pass_bucket == (widest,)
    assert a.plan.pass_microbatches[0] != b.plan.pass_microbatches[0]  # the same shape, another m
    setup = TrainSetup(model=cfg, pipeline_parallel_size=2, num_microbatches=m, schedule=schedule,
                       virtual_stages=virtual, loss=LOSS, timeout_s=60)
    after_b = run_local_pipeline(setup, hf_state(model), [b, a, b, a], calls=["grad", "grad", "proximal", "proximal"])
    alone = run_local_pipeline(setup, hf_state(model), [a, a], calls=["grad", "proximal"])
    for known, inferred in zip(after_b, alone):
        inferences = lambda out, call: out.steps[call].metrics["pipeline_shape_inferences"]  # noqa: E731
        assert [inferences(known, c) for c in range(4)] == [1, 1, 1, 1]  # A: only its narrow pass inferred
        assert [inferences(inferred, c) for c in range(2)] == [2, 2]
        assert set(known.grads[1]) == set(inferred.grads[0]) and known.grads[1]
        for name, g in inferred.grads[0].items():
            assert torch.equal(known.grads[1][name], g), name
    got = [(k.logps[3], i.logps[1]) for k, i in zip(after_b, alone) if i.logps[1] is not None]
    assert len(got) == 1 and torch.equal(*got[0])


def test_packed_rows_wider_than_the_longest_sequence_equal_single_process():
    """A packed bucket of 2S = 22 (rows holding two or more sequences of up to S = 11): step B goes
    there, and its gradient and log-probs through the pipeline are the single process's."""
    cfg = make_decoder_config()
    model = make_model(cfg)
    layout = bucketed_layout(len(STEP_B), G, PROMPT_WIDTH, MAX_NEW, BUDGET, (*WIDTHS, 22), True, 2, 1, None,
                             ("1f1b", 2, 1))
    assert [(b.rows, b.seq_len, b.max_seq_len) for b in layout.buckets][-1] == (2, 22, 11)
    arrays = arrays_for(model, STEP_B, seed=2)
    step = build_global_batch(arrays, "token-mean", 0, layout)
    assert step.plan.pass_bucket == (len(layout.buckets) - 1,)
    narrow = bucketed_layout(len(STEP_B), G, PROMPT_WIDTH, MAX_NEW, BUDGET, WIDTHS, True, 2, 1, None, ("1f1b", 2, 1))
    assert step.plan.num_slots < build_global_batch(arrays, "token-mean", 0, narrow).plan.num_slots  # 308 < 352
    setup = TrainSetup(model=cfg, pipeline_parallel_size=2, num_microbatches=2, schedule="1f1b", loss=LOSS,
                       timeout_s=60)
    outputs = run_local_pipeline(setup, hf_state(model), [step, step], calls=["grad", "proximal"])
    want = full_batch_grads(model, arrays, "token-mean")
    # A few float32 ulps: attention over 22 keys under a dense mask sums in other blocks than the
    # single process's 11-wide causal rows (masked keys add exact zeros); 1.2e-6 on a Zen 3.
    assert worst_diff(merged(outputs, 0, 1e-6), want) <= 3e-6
    assert max(g.abs().max().item() for g in want.values()) > 1e-2  # a gradient worth comparing
    got = [out.logps[1] for out in outputs if out.logps[1] is not None]
    assert len(got) == 1
    torch.testing.assert_close(got[0], torch.from_numpy(single_process_logp(model, arrays)), rtol=1e-5, atol=1e-6)
