"""train.reference_parallel=data: every rank holds the whole frozen reference and runs a share of
each forward-only pass's microbatches, then one reduction gathers the log-probs. The values are
the pipeline-split reference's bit for bit, on bucketed steps of several passes, on a V-shaped
schedule (whose last stage sits on pipeline rank 0) and over data-parallel replicas; the policy's
own passes (train, proximal) are untouched."""

from __future__ import annotations

import pytest
import torch

from conftest import make_decoder_config, make_model, make_rollout_arrays
from stages.policy import hf_state
from stages.train.batch import build_global_batch
from stages.train.buckets import bucketed_layout, microbatches_per_pass
from stages.train.engine import TrainSetup
from stages.train.local import run_local_pipeline
from stages.train.loss import token_logp
from stages.train.plan import microbatch_layout
from test_buckets_pipeline import (BUDGET, G, LOSS, MAX_NEW, PROMPT_WIDTH, STEP_A, STEP_B, WIDTHS, arrays_for,
                                   single_process_logp)

# reference B, train A (steps the weights), reference B (the reference is frozen), proximal B
CALLS = ["reference", "train", "reference", "proximal"]


@pytest.mark.parametrize("schedule, virtual, dp, packing, chunk", [
    ("1f1b", 1, 1, False, None),
    ("zbv", 2, 1, True, 3),
    ("1f1b", 1, 2, False, None),  # PP2 x DP2: four ranks share the microbatches
])
def test_data_parallel_reference_equals_the_pipeline_reference(schedule, virtual, dp, packing, chunk):
    cfg = make_decoder_config()
    model = make_model(cfg)
    m = microbatches_per_pass(schedule, 2, virtual)
    layout = bucketed_layout(len(STEP_A), G, PROMPT_WIDTH, MAX_NEW, BUDGET, WIDTHS, packing, m, dp)
    a, b = arrays_for(model, STEP_A, seed=1), arrays_for(model, STEP_B, seed=2)
    step_a, step_b = build_global_batch(a, "token-mean", 0, layout), build_global_batch(b, "token-mean", 0, layout)
    assert len(step_b.passes) >= 2  # passes of their own microbatch counts, shared out across them
    runs = {}
    for mode in ("pipeline", "data"):
        setup = TrainSetup(model=cfg, pipeline_parallel_size=2, num_microbatches=m, schedule=schedule,
                           virtual_stages=virtual, data_parallel_size=dp, loss=LOSS, logprob_chunk_tokens=chunk,
                           timeout_s=60, reference_parallel=mode)
        runs[mode] = run_local_pipeline(setup, hf_state(model), [step_b, step_a, step_b, step_b], calls=CALLS)

    def logp(mode: str, call: int) -> torch.Tensor:
        got = [out.logps[call] for out in runs[mode] if out.logps[call] is not None]
        assert len(got) == 1  # one output rank
        return got[0]

    want = torch.from_numpy(single_process_logp(model, b))
    for call in (0, 2):
        assert torch.equal(logp("data", call), logp("pipeline", call)), f"reference call {call}"
        # against the single process: other microbatch shapes, a few fp32 ulps (test_buckets_pipeline)
        torch.testing.assert_close(logp("data", call), want, rtol=1e-5, atol=1e-6)
    assert torch.equal(logp("data", 3), logp("pipeline", 3))  # proximal: the stepped policy, pipelined
    assert not torch.equal(logp("data", 3), logp("data", 0))  # ... which the step did change
    for ours, theirs in zip(runs["data"], runs["pipeline"]):  # the training step itself is untouched
        assert ours.state.keys() == theirs.state.keys()
        assert all(torch.equal(ours.state[k], theirs.state[k]) for k in ours.state)
    for out in runs["data"]:
        assert out.steps[0].metrics["step_seconds"] > 0 and 0 <= out.steps[0].metrics["bubble_fraction"] < 1


def test_data_parallel_reference_refuses_tensor_parallelism_and_unknown_modes():
    cfg = make_decoder_config()
    with pytest.raises(ValueError, match="tensor_parallel_size=2 use pipeline"):
        TrainSetup(model=cfg, pipeline_parallel_size=2, num_microbatches=2, tensor_parallel_size=2,
                   reference_parallel="data")
    with pytest.raises(ValueError, match="is not one of pipeline, data"):
        TrainSetup(model=cfg, pipeline_parallel_size=2, num_microbatches=2, reference_parallel="replicated")


@pytest.mark.parametrize("dp", [1, 2])
def test_data_parallel_reference_on_the_fixed_layout(dp):
    """The run's fixed layout (a pass without its own microbatch count: the setup's count per
    data-parallel rank), as the tiny config runs it, at DP 1 and DP 2."""
    cfg = make_decoder_config()
    model = make_model(cfg)
    arrays = make_rollout_arrays(model, num_groups=8, group_size=4, prompt_width=5, max_new_tokens=6, seed=3)
    layout = microbatch_layout(8, 4, 5, 6, 4 * 11, packing=False, data_parallel_size=dp)
    batch = build_global_batch(arrays, "token-mean", 0, layout)
    assert batch.num_microbatches is None and layout.num_microbatches == 8
    got = {}
    for mode in ("pipeline", "data"):
        setup = TrainSetup(model=cfg, pipeline_parallel_size=2, num_microbatches=layout.num_microbatches // dp,
                           data_parallel_size=dp, loss=LOSS, timeout_s=60, reference_parallel=mode)
        outputs = run_local_pipeline(setup, hf_state(model), [batch], calls=["reference"])
        (got[mode],) = [out.logps[0] for out in outputs if out.logps[0] is not None]
    assert torch.equal(got["data"], got["pipeline"])
    want = build_global_batch(arrays, "token-mean", 0)  # one padded row per sample, one forward
    with torch.no_grad():
        ref = want.completion_values(token_logp(model(want.input_ids), want.target[..., 0].long(), LOSS.temperature))
    torch.testing.assert_close(torch.from_numpy(batch.completion_values(got["data"])), torch.from_numpy(ref),
                               rtol=0, atol=1e-5)
