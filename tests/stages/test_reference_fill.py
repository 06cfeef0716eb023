"""train.reference_fill: with the reference whole on every rank and its pass fused into the train
step, the ranks plan some of its microbatches into the step's P2P waits, measured in the
previous step (stages/train/fill.py). A filled microbatch's log-probs are computed by the same
whole reference over the same rows, so the step is the plain fused step's bit for bit: weights,
gradients and the stored log-probs, on every schedule, over length buckets and data-parallel
replicas. The waits are made long enough to fill by stalling a peer's forward (a test fault)."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch

from conftest import make_decoder_config, make_model
from stages.layout import ParallelLayout
from stages.policy import hf_state
from stages.train.batch import build_global_batch
from stages.train.buckets import bucketed_layout, microbatches_per_pass
from stages.train.engine import InjectedFault, TrainSetup
from stages.train.fill import FILL_SHARE, Fill, WaitRecord, first_fillable, offer, plan_fill
from stages.train.local import run_local_pipeline
from stages.train.plan import microbatch_layout
from test_buckets_pipeline import BUDGET, G, LOSS, MAX_NEW, PROMPT_WIDTH, STEP_B, WIDTHS, arrays_for

CALLS = ["train_with_reference"] * 3
STALL_S = 0.25


def _stalls(rank: int) -> tuple[InjectedFault, ...]:
    """A stall in ``rank``'s first forward of the second and third train pass (call c runs the
    pre-step pass as pass 2c, the pipeline step as 2c + 1). The first step's waits are not
    planned from (they hold torch's shape inference): the second step's stall is measured, the
    third step's is filled."""
    return tuple(InjectedFault(rank, "stall", step=2 * c + 1, microbatch=0, seconds=STALL_S) for c in (1, 2))


def _run(setup: TrainSetup, model, batch):
    return run_local_pipeline(setup, hf_state(model), [batch] * len(CALLS), calls=CALLS)


@pytest.mark.parametrize("schedule, virtual, dp, bucketed, stalled", [
    ("1f1b", 1, 1, False, 1),  # the tiny config's layout: rank 0 fills while rank 1 stalls
    ("gpipe", 1, 1, False, 0),  # every forward before any backward: the last stage fills its own
    ("interleaved-1f1b", 2, 1, False, 1),
    ("zb-h1", 1, 1, False, 1),
    ("zbv", 2, 1, False, 1),  # V-shaped: the loss on rank 0, which fills its own
    ("dualpipev", 2, 1, False, 1),
    ("1f1b", 1, 1, True, 1),  # length buckets: a wait of the first pass fills the later passes' too
    ("1f1b", 1, 2, False, 1),  # PP2 x DP2: each replica's first stage fills for its last stage
])
def test_a_step_with_reference_fills_equals_the_plain_fused_step(schedule, virtual, dp, bucketed, stalled):
    cfg = make_decoder_config()
    model = make_model(cfg)
    m = max(microbatches_per_pass(schedule, 2, virtual), 4)
    if bucketed:
        layout = bucketed_layout(len(STEP_B), G, PROMPT_WIDTH, MAX_NEW, BUDGET, WIDTHS, False, m, dp)
        num_mb = m
    else:
        layout = microbatch_layout(len(STEP_B), G, PROMPT_WIDTH, MAX_NEW, BUDGET // 2, packing=False,
                                   data_parallel_size=dp)
        num_mb = layout.num_microbatches // dp
    arrays = arrays_for(model, STEP_B, seed=5)
    batch = build_global_batch({**arrays, "ref_logp": np.zeros_like(arrays["ref_logp"])}, "token-mean", 0, layout)
    plain = TrainSetup(model=cfg, pipeline_parallel_size=2, num_microbatches=num_mb, schedule=schedule,
                       virtual_stages=virtual, data_parallel_size=dp, loss=LOSS, timeout_s=60,
                       reference_parallel="data", faults=sum((_stalls(r) for r in range(2 * dp) if
                                                              ParallelLayout(2, dp).coord(r).pp == stalled), ()))
    want = _run(plain, model, batch)
    got = _run(replace(plain, reference_fill=True), model, batch)
    filled = [sum(o.steps[c].metrics["reference_fill_microbatches"] for o in got) for c in range(len(CALLS))]
    assert filled[0] == 0 and filled[2] > 0, filled  # planned from a step before
    # the plan went on the second step's stall, measured by the rank it left waiting
    assert max(o.steps[2].metrics["reference_fill_wait_seconds"] for o in got) > STALL_S / 2
    assert all("reference_fill_microbatches" not in o.steps[1].metrics for o in want)
    for c in range(len(CALLS)):
        for ours, theirs in zip(got, want):
            assert (ours.logps[c] is None) == (theirs.logps[c] is None)
            if ours.logps[c] is not None:
                assert torch.equal(ours.logps[c], theirs.logps[c]), c
            assert ours.grads[c].keys() == theirs.grads[c].keys()
            for name in ours.grads[c]:
                assert torch.equal(ours.grads[c][name], theirs.grads[c][name]), (c, name)
            assert ours.steps[c].metrics.get("loss") == theirs.steps[c].metrics.get("loss"), c
    for ours, theirs in zip(got, want):
        assert ours.state.keys() == theirs.state.keys()
        for name in ours.state:
            assert torch.equal(ours.state[name], theirs.state[name]), name


def test_an_offer_is_the_share_of_the_longest_wait_with_something_to_fill():
    ms = 1_000_000
    waits = [WaitRecord(10 * ms, 10 * ms, forwarded=1), WaitRecord(40 * ms, 40 * ms, forwarded=2),
             WaitRecord(90 * ms, 90 * ms, forwarded=8)]  # the drain: every microbatch of the pass forwarded
    assert offer(waits, num_microbatches=8, later_passes=False) == (1, 2, int(FILL_SHARE * 40 * ms))
    assert offer(waits, num_microbatches=8, later_passes=True) == (2, 8, int(FILL_SHARE * 90 * ms))
    assert offer(waits[2:], num_microbatches=8, later_passes=False) == (0, 0, 0)
    # A fill that left no blocked time most likely ran past the op: half of what it filled.
    assert offer([WaitRecord(40 * ms, 0, forwarded=0, filled=3)], 8, False) == (0, 0, 20 * ms)
    assert first_fillable({0: 2, 3: 0}, last_stage=3) == 0  # the loss's own rank: its last stage's forwards
    assert first_fillable({1: 3, 2: 1}, last_stage=3) == 1


def _offers(rank_offers, times):
    return [[(*o, t) for o, t in zip(offers, times)] for offers in rank_offers]


def test_the_plan_takes_the_latest_microbatches_that_fit_and_balances_the_rest():
    layout = ParallelLayout(pp=2)
    none = plan_fill(_offers([[(0, 0, 0)], [(0, 0, 0)]], [10]), [8], [1.0], layout)
    assert none.owner == ((0, 1, 0, 1, 0, 1, 0, 1),) and none.num_filled == 0  # round robin, as without fills
    plan = plan_fill(_offers([[(0, 2, 25)], [(0, 0, 0)]], [10]), [8], [1.0], layout)  # 25 ns: two of 10
    assert plan.fills == (Fill(0, 7, 0, 0, 0), Fill(0, 6, 0, 0, 0))
    assert plan.owner[0][6:] == (-1, -1) and sorted(plan.owner[0][:6]) == [0, 0, 0, 1, 1, 1]
    # One fill of 8 leaves 4 and 3 to compute before the step, as long as 4 and 4: nothing is filled.
    assert plan_fill(_offers([[(0, 2, 15)], [(0, 0, 0)]], [10]), [8], [1.0], layout) == none
    # Data-parallel replicas: a rank fills only its own replica's microbatches (k // (M / D)).
    dp = ParallelLayout(pp=2, dp=2)
    plan = plan_fill(_offers([[(0, 1, 20)], [(0, 1, 20)], [(0, 0, 0)], [(0, 0, 0)]], [10]), [8], [1.0], dp)
    assert [(f.microbatch, f.rank) for f in plan.fills] == [(3, 0), (2, 0), (7, 1), (6, 1)]
    assert sorted(plan.owner[0]) == [-1, -1, -1, -1, 0, 1, 2, 3]
    # Length buckets: the drain of pass 0 (every microbatch of it forwarded) fills pass 1's, at
    # this rank's time for a microbatch of pass 1; the rest, the larger first, onto the least loaded.
    plan = plan_fill(_offers([[(3, 2, 45), (0, 0, 0)], [(0, 0, 0), (0, 0, 0)]], [10, 20]), [2, 4], [1.0, 2.0],
                     layout)
    assert plan.fills == (Fill(1, 3, 0, 0, 3), Fill(1, 2, 0, 0, 3))
    assert plan.owner == ((0, 1), (0, 1, -1, -1))


def test_the_config_key():
    from flows.config import load_config
    from stages.config import ConfigError
    from stages.train.setup import train_setup

    model = make_decoder_config()
    on = load_config("configs/tiny.yaml", [])  # the tiny config fuses the reference pass
    assert on.train.reference_fill == "auto" and train_setup(on.train, model, 2, 1.0).reference_fill
    for overrides in (["train.reference_fill=false"], ["train.reference_pass=separate"]):
        assert not train_setup(load_config("configs/tiny.yaml", overrides).train, model, 2, 1.0).reference_fill
    with pytest.raises(ConfigError, match="train.reference_fill='sometimes' must be auto or false"):
        load_config("configs/tiny.yaml", ["train.reference_fill=sometimes"])
