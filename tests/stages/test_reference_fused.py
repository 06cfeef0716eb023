"""train.reference_pass=fused: the training ranks run the frozen reference's forward-only pass over
the step's own batch and put its log-probs in the target before their optimiser step
(TrainRank.train_step_with_reference). The target is the one a batch built from stored log-probs
holds, bit for bit, so the gradient is the separate reference stage's bit for bit, on padded,
packed and bucketed layouts, with the reference pipelined or whole on every rank, a V-shaped
schedule (the loss on pipeline rank 0) and data-parallel replicas (each computing the loss on its
own rows)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from conftest import make_decoder_config, make_model
from stages.policy import hf_state
from stages.train.batch import BucketedBatch, build_global_batch
from stages.train.buckets import bucketed_layout, microbatches_per_pass
from stages.train.engine import TrainSetup
from stages.train.local import run_local_pipeline
from stages.train.loss import TARGET_FIELDS
from stages.train.plan import microbatch_layout
from test_buckets_pipeline import BUDGET, G, LOSS, MAX_NEW, PROMPT_WIDTH, STEP_B, WIDTHS, arrays_for

_REF = TARGET_FIELDS.index("ref_logp")


def _layouts(num_groups: int):
    yield "one row per sample", None
    yield "fixed, padded", microbatch_layout(num_groups, G, PROMPT_WIDTH, MAX_NEW, BUDGET, packing=False)
    yield "fixed, packed", microbatch_layout(num_groups, G, PROMPT_WIDTH, MAX_NEW, BUDGET, packing=True)
    yield "buckets, padded", bucketed_layout(num_groups, G, PROMPT_WIDTH, MAX_NEW, BUDGET, WIDTHS, False, 2)
    yield "buckets, packed", bucketed_layout(num_groups, G, PROMPT_WIDTH, MAX_NEW, BUDGET, WIDTHS, True, 2)


def test_completion_values_put_in_the_target_give_the_batch_built_with_them():
    arrays = arrays_for(make_model(make_decoder_config()), STEP_B, seed=3)
    ref = arrays["ref_logp"]
    assert np.count_nonzero(ref) > 50
    zero = {**arrays, "ref_logp": np.zeros_like(ref)}
    failed = np.zeros(len(ref), bool)
    failed[[1, 9]] = True  # masked samples keep their values in the channel, as when built
    for name, layout in _layouts(len(STEP_B)):
        want = build_global_batch(arrays, "token-mean", 0, layout, reward_failed=failed, group_size=G)
        got = build_global_batch(zero, "token-mean", 0, layout, reward_failed=failed, group_size=G)
        got = got.with_completion_values("ref_logp", ref)
        for w, g in zip(getattr(want, "passes", (want,)), getattr(got, "passes", (got,)), strict=True):
            assert torch.equal(w.target, g.target), name
            assert torch.equal(w.input_ids, g.input_ids), name
        channel = [p.target[..., _REF] for p in got.passes]
        back = got.completion_values(channel if isinstance(got, BucketedBatch) else channel[0])
        np.testing.assert_array_equal(back, ref, err_msg=name)
    with pytest.raises(ValueError, match="ref_logp: values of shape"):
        build_global_batch(zero, "token-mean", 0).with_completion_values("ref_logp", ref[:, :-1])


@pytest.mark.parametrize("schedule, virtual, dp, reference, bucketed", [
    ("1f1b", 1, 1, "data", False),  # the tiny config's layout
    ("1f1b", 1, 2, "pipeline", True),  # PP2 x DP2: each replica's last stage gets its own rows
    ("zbv", 2, 1, "data", True),  # V-shaped: the loss is on pipeline rank 0
])
def test_training_with_the_fused_reference_equals_the_separate_reference(schedule, virtual, dp, reference, bucketed):
    cfg = make_decoder_config()
    model = make_model(cfg)
    m = microbatches_per_pass(schedule, 2, virtual)
    if bucketed:
        layout = bucketed_layout(len(STEP_B), G, PROMPT_WIDTH, MAX_NEW, BUDGET, WIDTHS, False, m, dp)
    else:
        layout = microbatch_layout(len(STEP_B), G, PROMPT_WIDTH, MAX_NEW, BUDGET, packing=False,
                                   data_parallel_size=dp)
    arrays = arrays_for(model, STEP_B, seed=4)
    unset = build_global_batch({**arrays, "ref_logp": np.zeros_like(arrays["ref_logp"])}, "token-mean", 0, layout)
    num_mb = layout.num_microbatches // dp if not bucketed else m
    setup = TrainSetup(model=cfg, pipeline_parallel_size=2, num_microbatches=num_mb, schedule=schedule,
                       virtual_stages=virtual, data_parallel_size=dp, loss=LOSS, timeout_s=60,
                       reference_parallel=reference)
    # Fused: the separate pass first (what the reference stage would store), then the fused step.
    fused = run_local_pipeline(setup, hf_state(model), [unset, unset], calls=["reference", "train_with_reference"])
    stored = next(o.logps[0] for o in fused if o.logps[0] is not None)
    if not bucketed:  # a fixed layout's pass gives [rows, T]; store order, as the reference stage stores it
        stored = torch.from_numpy(unset.completion_values(stored))
    assert len([o for o in fused if o.logps[1] is not None]) == 1  # handed back on the output rank only
    assert torch.equal(next(o.logps[1] for o in fused if o.logps[1] is not None), stored)
    assert all("reference_seconds" in o.steps[1].metrics for o in fused)
    # Separate: the step built from the stored log-probs (train: clipped gradients, as the fused
    # step's); before it, gradients with and without them, to show they count.
    rebuilt = build_global_batch({**arrays, "ref_logp": stored.numpy()}, "token-mean", 0, layout)
    separate = run_local_pipeline(setup, hf_state(model), [rebuilt, unset, rebuilt], calls=["grad", "grad", "train"])
    grads = [{n: g for o in separate for n, g in o.grads[call].items()} for call in range(3)]
    got = {n: g for o in fused for n, g in o.grads[1].items()}
    assert grads[2].keys() == got.keys() and len(got) > 0
    for name in got:
        assert torch.equal(got[name], grads[2][name]), name
    assert any(not torch.equal(grads[0][n], grads[1][n]) for n in got)  # the KL term moved the gradient
    for ours, theirs in zip(fused, separate):
        assert ours.state.keys() == theirs.state.keys()
        for name in ours.state:
            assert torch.equal(ours.state[name], theirs.state[name]), name
