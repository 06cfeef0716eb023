"""The planner's formulas against what the runtime allocates and measures."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from conftest import make_decoder_config, make_model, make_rollout_arrays
from planner import (
    TORCH_EAGER_IMPL,
    build_pipeline_order,
    estimate_activation_breakdown,
    estimate_activation_bytes_per_microbatch,
    model_from_hf_config,
    simulate_schedule,
)
from planner.calibrate import estimate_durations_from_trace, measured_step_seconds, relative_error
from planner.rollout import estimate_paged_kv_bytes
from stages.layout import layers_per_stage
from stages.policy import hf_state
from stages.rollout import EngineConfig, SamplingParams, generate
from stages.train.batch import build_global_batch
from stages.train.engine import StepResult, TrainSetup
from stages.train.local import run_local_pipeline
from stages.train.plan import microbatch_layout
from stages.train.timeline import COMPUTE_KINDS, chrome_events

_FP32_BYTES = 4  # the runtime trains in fp32


@pytest.mark.parametrize("layers, heads, kv_heads, head_dim, prompts, G, new, page, seed", [
    (2, 4, 2, 8, 3, 4, 5, 4, 0), (3, 4, 4, 16, 2, 8, 7, 3, 1), (1, 8, 1, 4, 5, 2, 3, 16, 2), (2, 4, 2, 8, 6, 3, 9, 1, 3)])
def test_paged_kv_formula_matches_the_engine_allocation_exactly(layers, heads, kv_heads, head_dim, prompts, G, new,
                                                                page, seed):
    """Random prompt lengths and stop-token completion lengths: blocks x block bytes, counted exactly."""
    cfg = make_decoder_config(num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
                              head_dim=head_dim)
    model = make_model(cfg, std=1.0)  # a peaked model, so the stop token ends samples at spread lengths
    rng = np.random.default_rng(seed)
    lengths = rng.integers(1, 3 * page + 2, prompts).tolist()
    batch = generate(model, [[1] + rng.integers(3, 17, n - 1).tolist() for n in lengths],
                     SamplingParams(group_size=G, max_new_tokens=new, stop_ids=(2, 5, 7), temperature=1.5),
                     torch.Generator().manual_seed(seed), EngineConfig(page_size=page, max_num_seqs=2 * G))
    completions = batch.length.reshape(prompts, G).tolist()
    predicted = estimate_paged_kv_bytes(model_from_hf_config(cfg.to_hf()), lengths, completions, page, dtype_bytes=4)
    assert batch.kv_allocated_bytes == predicted
    assert batch.kv_cache_bytes < predicted, "with 2 groups live at most, the peak is below the total"


# -- step time: the schedule simulator fed with a real timeline -------------------------------------------
# Big enough that compute (5-15 ms per action) dominates the schedule's Python overhead, small
# enough for ~0.5 s steps: 8 layers of h = 256 on 2 ranks, 8 microbatches of 2 rows x 32 tokens.
_TIMED_MODEL = dict(vocab_size=64, hidden_size=256, intermediate_size=704, num_hidden_layers=8,
                    num_attention_heads=8, num_key_value_heads=4, head_dim=32)
_TIMED_MICROBATCHES = 8
_TIMED_STEPS, _WARMUP_STEPS = 6, 1  # step 0 also infers shapes and connects gloo's pairs
_STEP_TOLERANCE = 0.10


def _trace(step: list[StepResult]) -> list[dict]:
    """The step's Chrome-trace events, as the flow writes them to runs/<run>/timelines/step_k.json."""
    origin = min(r.window_ns[0] for r in step)
    return [e for r in step for e in chrome_events(r.rank, r.actions, r.window_ns, origin)]


@pytest.mark.parametrize("schedule, virtual", [("1f1b", 1), ("gpipe", 1), ("zbv", 2)])
def test_simulated_step_time_matches_the_measured_step(schedule, virtual):
    cfg = make_decoder_config(**_TIMED_MODEL)
    model = make_model(cfg, std=0.02)
    arrays = make_rollout_arrays(model, num_groups=4, group_size=4, prompt_width=8, max_new_tokens=24)
    m = _TIMED_MICROBATCHES
    setup = TrainSetup(model=cfg, pipeline_parallel_size=2, num_microbatches=m, schedule=schedule,
                       virtual_stages=virtual, timeout_s=60)
    outputs = run_local_pipeline(setup, hf_state(model), [build_global_batch(arrays, "token-mean", 0)] * _TIMED_STEPS)
    order = build_pipeline_order(schedule, 2, m, virtual)
    errors = []
    for call in range(_WARMUP_STEPS, _TIMED_STEPS):
        step = [out.steps[call] for out in outputs]
        for result in step:  # the simulated order is the one the runtime executed
            ran = sorted((a for a in result.actions if a.kind in COMPUTE_KINDS), key=lambda a: a.start_ns)
            assert [(a.kind, a.stage, a.microbatch) for a in ran] == list(order.rank_actions[result.rank])
        trace = _trace(step)
        predicted = simulate_schedule(schedule, 2, m, virtual, estimate_durations_from_trace(trace)).makespan_s
        errors.append(relative_error(predicted, measured_step_seconds(trace)))
    # Each step against its own durations, then the best step: a stall the shared machine puts
    # between two actions (a rank descheduled) shows in no duration and only adds to the measured
    # step, and under load most steps carry one (medians of 0.10-0.13 seen). An error of the
    # simulator itself is in every step, the quietest included.
    assert min(errors) <= _STEP_TOLERANCE, (
        f"{schedule}: simulated vs measured step, relative errors {[round(e, 3) for e in errors]}")


# -- activation stash: the memory model against the runtime's saved-tensor bytes ---------------------------
_ACTIVATION_TOLERANCE = 0.05  # the two agree to the byte today (fp32, torch 2.13)


@pytest.mark.parametrize("model_type, tied", [("llama", False), ("qwen2", True)])
def test_activation_estimate_matches_the_saved_tensor_bytes_of_every_stage(model_type, tied):
    # 4 stages on 2 ranks (interleaved, v = 2): first, two middle, last; 5 layers split 2/1/1/1.
    cfg = make_decoder_config(num_hidden_layers=5, model_type=model_type, attention_bias=model_type == "qwen2",
                              tie_word_embeddings=tied)
    model = make_model(cfg)
    groups, G, prompt_width, max_new, m = 4, 4, 5, 6, 4
    arrays = make_rollout_arrays(model, num_groups=groups, group_size=G, prompt_width=prompt_width,
                                 max_new_tokens=max_new)
    padded = build_global_batch(arrays, "token-mean", 0)  # [16, 11]: one sample per row
    # Short samples packed two or more to a row of the same [16, 11] shape (a pipeline keeps its
    # first step's shapes), told apart by doc_ids: attention then takes an explicit mask.
    short = dict(arrays, prompt_len=np.minimum(arrays["prompt_len"], 3), length=np.minimum(arrays["length"], 2))
    layout = microbatch_layout(groups, G, prompt_width, max_new, 44, packing=True, pack_row_tokens=11)
    packed = build_global_batch(short, "token-mean", 0, layout)
    assert packed.input_ids.shape == padded.input_ids.shape and int(packed.doc_ids[0].max()) >= 1
    setup = TrainSetup(model=cfg, pipeline_parallel_size=2, num_microbatches=m, schedule="interleaved-1f1b",
                       virtual_stages=2, timeout_s=60)
    outputs = run_local_pipeline(setup, hf_state(model), [padded, packed], optimizer_step=False)

    shape, num_stages = model_from_hf_config(cfg.to_hf()), 4
    layers = layers_per_stage(cfg.num_hidden_layers, num_stages)
    assert layers == (2, 1, 1, 1)
    masked = dataclasses.replace(TORCH_EAGER_IMPL, attention="flash-masked")
    for call, (batch, impl) in enumerate([(padded, TORCH_EAGER_IMPL), (packed, masked)]):
        rows, seq_len = batch.input_ids.shape[0] // m, batch.input_ids.shape[1]
        measured = {k: v for out in outputs for k, v in out.steps[call].metrics.items()
                    if k.startswith("activation_bytes_per_microbatch_stage")}
        assert len(measured) == num_stages
        for s in range(num_stages):
            # The loss runs in the schedule's loss_fn, outside the measured stage forward: no log-softmax.
            predicted = estimate_activation_bytes_per_microbatch(
                shape, rows, seq_len, layers[s], _FP32_BYTES, "none", is_first_stage=s == 0,
                is_last_stage=s == num_stages - 1, impl=impl, logits_dtype_bytes=0)
            got = measured[f"activation_bytes_per_microbatch_stage{s}"]
            assert relative_error(predicted, got) <= _ACTIVATION_TOLERANCE, (model_type, call, s, predicted, got)
        # The first stage keeps its own microbatch's token ids (2 layers + ids vs 1 layer on stage 1),
        # not the whole batch its input is a view of; each stage keeps one cos and one sin table
        # [rows, 1, seq_len, head_dim], shared by its layers.
        ids_bytes = estimate_activation_breakdown(shape, rows, seq_len, layers[0], _FP32_BYTES,
                                                  is_first_stage=True).embedding_bytes
        rope_bytes = 2 * rows * seq_len * cfg.head_dim * _FP32_BYTES
        first, middle = (measured[f"activation_bytes_per_microbatch_stage{s}"] for s in (0, 1))
        assert first - 2 * middle == ids_bytes - rope_bytes
