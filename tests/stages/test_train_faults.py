"""A failing rank or disagreeing inputs end the call on every rank, within the timeout, with an
error that names the rank and the cause; the process group survives input errors."""

from __future__ import annotations

import torch

from conftest import make_decoder_config, make_model, make_rollout_arrays
from stages.policy import hf_state
from stages.train.batch import build_global_batch
from stages.train.engine import InjectedFault, TrainSetup
from stages.train.local import run_local_pipeline

TIMEOUT_S = 3.0
SLACK_S = 3.0  # a loaded 2-core machine: scheduling, the failure report round trip


def test_faults_are_reported_by_every_rank_within_the_timeout():
    cfg = make_decoder_config()
    model = make_model(cfg)
    batch = build_global_batch(make_rollout_arrays(model, num_groups=4, group_size=4), "token-mean", 0)
    smaller = build_global_batch(make_rollout_arrays(model, num_groups=2, group_size=4), "token-mean", 0)
    faults = (InjectedFault(rank=1, kind="shape", step=1),  # rank 1 feeds one row fewer
              InjectedFault(rank=1, kind="raise", step=4, microbatch=1))  # rank 1 fails mid-schedule
    setup = TrainSetup(model=cfg, pipeline_parallel_size=2, num_microbatches=2, schedule="1f1b",
                       timeout_s=TIMEOUT_S, faults=faults)
    outputs = run_local_pipeline(setup, hf_state(model), [batch, batch, smaller, batch, batch, batch],
                                 calls=["train"] * 5 + ["grad"], stop_on_error=False)
    for out in outputs:
        first, mismatch, reshaped, ok, failed, after = out.errors
        assert first is None
        assert mismatch.startswith("InputMismatchError") and "rank 1 has input_ids=(15, 11)" in mismatch
        assert "rank 0 has (16, 11)" in mismatch and "\n" not in mismatch
        assert reshaped.startswith("TrainInputError") and "input_ids (16, 11):int64 -> (8, 11):int64" in reshaped
        assert ok is None and out.steps[3].metrics["grad_norm"] > 0  # the group survived both input errors
        assert failed.startswith("TrainStepError")
        assert "rank 1 (pp=1, dp=0, tp=0): RuntimeError: injected fault: rank 1 fails in the forward of " \
               "microbatch 1" in failed
        assert out.seconds[4] < TIMEOUT_S + SLACK_S, out.seconds
        assert "aborted" in after and out.state == {}
    survivor = outputs[0].errors[4]
    assert "aborted on rank 0" in survivor and "the first failure was on rank 1" in survivor
    assert "with rank 1" in survivor  # the wait that timed out names its peer


def test_a_non_finite_gradient_stops_the_step_before_any_weight_moves():
    """A NaN weight (a broken model folder) makes the loss and the gradient norm NaN: every rank
    refuses the optimiser step with the same one line naming where the gradients are not finite,
    and no weight moves."""
    cfg = make_decoder_config()
    model = make_model(cfg)
    broken = {k: v.clone() for k, v in hf_state(model).items()}
    broken["model.layers.3.mlp.down_proj.weight"][0, 0] = float("nan")  # on the last stage (pp=1)
    batch = build_global_batch(make_rollout_arrays(model, num_groups=4, group_size=4), "token-mean", 0)
    setup = TrainSetup(model=cfg, pipeline_parallel_size=2, num_microbatches=2, schedule="1f1b", timeout_s=TIMEOUT_S)
    outputs = run_local_pipeline(setup, broken, [batch], calls=["train"], stop_on_error=False)
    messages = {out.errors[0] for out in outputs}
    assert len(messages) == 1, messages
    (message,) = messages
    assert message.startswith("NonFiniteGradientError: the gradient norm is nan") and "\n" not in message
    assert "rank 1: " in message and "nothing is published" in message
    for out in outputs:  # no optimiser step: every weight the rank holds is still the input's
        assert out.state
        for name, value in out.state.items():
            assert torch.equal(value.nan_to_num(), broken[name].nan_to_num()), name
