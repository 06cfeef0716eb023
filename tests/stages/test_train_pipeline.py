"""The pipeline-parallel step computes the single-process full-batch gradient."""

from __future__ import annotations

import pytest
import torch

from conftest import make_decoder_config, make_model, make_rollout_arrays
from stages.config import LOSS_AGGREGATIONS
from stages.policy import hf_named_parameters, hf_state
from stages.train.batch import build_global_batch
from stages.train.engine import TrainSetup
from stages.train.local import run_local_pipeline
from stages.train.loss import LossConfig, grpo_microbatch_loss

LOSS = LossConfig(clip_eps_low=0.2, clip_eps_high=0.28, kl_beta=0.1, temperature=0.9)


def full_batch_grads(model, batch) -> dict[str, torch.Tensor]:
    model.zero_grad(set_to_none=True)
    loss, _ = grpo_microbatch_loss(model(batch.input_ids), batch.target, LOSS)
    loss.backward()
    return {name: p.grad.clone() for name, p in hf_named_parameters(model)}


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe"])
@pytest.mark.parametrize("tied", [False, True])
def test_pp2_gradient_equals_single_process(schedule, tied):
    cfg = make_decoder_config(tie_word_embeddings=tied)
    model = make_model(cfg)
    arrays = make_rollout_arrays(model, num_groups=4, group_size=4)
    batches = [build_global_batch(arrays, mode, 0) for mode in LOSS_AGGREGATIONS]
    setup = TrainSetup(model=cfg, num_stages=2, num_microbatches=4, schedule=schedule, loss=LOSS, timeout_s=60)
    outputs = run_local_pipeline(setup, hf_state(model), batches, optimizer_step=False)
    for i, mode in enumerate(LOSS_AGGREGATIONS):
        expected = full_batch_grads(model, batches[i])
        got = {}
        for out in outputs:
            for name, g in out.grads[i].items():
                # A tied embedding is held by both end stages with the same (summed) gradient.
                if name in got:
                    torch.testing.assert_close(got[name], g, rtol=0, atol=1e-7)
                got[name] = g
        assert set(got) == set(expected), mode
        worst = max((got[n] - expected[n]).abs().max().item() for n in expected)
        assert worst <= 1e-6, f"{mode}: max abs gradient difference {worst:.2e}"
        assert max(g.abs().max().item() for g in expected.values()) > 1e-3  # a gradient worth comparing


def test_microbatch_losses_sum_to_full_batch_loss():
    model = make_model()
    arrays = make_rollout_arrays(model, num_groups=3, group_size=4)
    for mode in LOSS_AGGREGATIONS:
        batch = build_global_batch(arrays, mode, 0)
        with torch.no_grad():
            full, _ = grpo_microbatch_loss(model(batch.input_ids), batch.target, LOSS)
            parts = sum(grpo_microbatch_loss(model(ids), tgt, LOSS)[0]
                        for ids, tgt in zip(batch.input_ids.split(3), batch.target.split(3)))
        torch.testing.assert_close(parts, full, rtol=1e-6, atol=1e-7)
