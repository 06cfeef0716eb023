"""Model FLOPs of a step (stages/perf/flops.py): a hand count, the planner's formula, and what
torch's FlopCounterMode measures on the project's own decoder."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from conftest import make_decoder_config, make_model
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from planner.model import ModelShape as PlannerShape
from planner.model import (estimate_forward_flops_per_token, estimate_layer_parameter_count, model_from_hf_config,
                           model_from_preset)
from stages.layout import ModelShape
from stages.perf import (STEP_PHASES, forward_flops, mfu, reference_flops, rollout_flops, score_flops,
                         step_model_flops, train_flops)


def make_shape(**overrides) -> ModelShape:
    fields = dict(vocab_size=10, hidden_size=4, intermediate_size=6, num_hidden_layers=2, num_attention_heads=2,
                  num_key_value_heads=1, head_dim=2)
    fields.update(overrides)
    return ModelShape(**fields)


# make_shape() by hand, in the planner's count: a layer has q 4*4 + k, v 2*(4*2) + o 4*4 + MLP 3*4*6
# + norms 2*4 = 128 weights, so W = 2 * 2 layers * 128 = 512, H = 2 * 10 * 4 = 80 and K = 4 * 2 * 4 = 32
# per key; a token at position i costs W + 32 i.
_W, _H, _K = 512, 80, 32


def test_forward_of_whole_sequences_by_hand():
    # s = 3: 3 W + K (1 + 2 + 3) + 3 H = 1536 + 192 + 240
    assert forward_flops(make_shape(), [3]) == 1968
    assert forward_flops(make_shape(), [3, 1]) == 1968 + _W + _K + _H
    assert forward_flops(make_shape(), []) == 0


def test_score_train_and_reference_by_hand():
    shape = make_shape()
    # P = 2, C = 3: positions 1..4 through the layers, the lm_head on the 3 that predict the completion
    score = 4 * _W + _K * (1 + 2 + 3 + 4) + 3 * _H
    assert score == 2608
    assert score_flops(shape, [2], [3]) == reference_flops(shape, [2], [3]) == score
    assert score_flops(shape, [2], [3], head_only_completion=False) == score + _H  # and on the last prompt token
    assert train_flops(shape, [2], [3]) == 3 * score  # backward = 2 x forward
    assert score_flops(shape, [2], [0]) == 0  # nothing to score


def test_rollout_by_hand_shares_the_prefill_of_a_group():
    shape = make_shape()
    prefill = 2 * _W + _K * (1 + 2) + _H  # P = 2 once, its last logits give every sample's first token
    decode = 2 * _W + _K * (3 + 4) + 2 * _H  # C = 3: tokens 1 and 2 fed back at positions 3, 4
    assert rollout_flops(shape, [2, 2], [3, 1], group_size=2) == prefill + decode  # C = 1 feeds nothing back
    # Without sharing, generating a sample costs exactly scoring it.
    assert rollout_flops(shape, [2, 2, 5], [3, 1, 4]) == score_flops(shape, [2, 2, 5], [3, 1, 4])
    # Sharing saves the prefill of the G - 1 other samples.
    assert (rollout_flops(shape, [2, 2], [3, 1]) - rollout_flops(shape, [2, 2], [3, 1], group_size=2)
            == prefill)


def test_step_flops_of_the_trained_samples():
    shape = make_shape()
    prompts, completions = [2, 2, 3, 3], [3, 1, 2, 4]
    flops = step_model_flops(shape, prompts, completions, group_size=2, reference=True, trained=[1, 0, 1, 1])
    assert tuple(flops) == STEP_PHASES
    assert flops["rollout"] == rollout_flops(shape, prompts, completions, group_size=2)  # every sample generated
    assert flops["reference"] == score_flops(shape, [2, 3, 3], [3, 2, 4])
    assert flops["train"] == 3 * flops["reference"]
    assert step_model_flops(shape, prompts, completions, group_size=2, reference=False)["reference"] == 0.0


@pytest.mark.parametrize("bad", [dict(prompt_lens=[2, 3], completion_lens=[1, 1], group_size=2),
                                 dict(prompt_lens=[2, 2, 2], completion_lens=[1, 1, 1], group_size=2),
                                 dict(prompt_lens=[2], completion_lens=[1, 1], group_size=1),
                                 dict(prompt_lens=[0], completion_lens=[1], group_size=1)])
def test_lengths_that_do_not_fit_are_refused(bad):
    with pytest.raises(ValueError):
        rollout_flops(make_shape(), **bad)


def test_the_planner_formula_is_the_same_count():
    """The planner prices a causal sequence of s tokens at s tokens of K s / 2; the exact sum over
    positions adds the diagonal, K s / 2. Also for a preset with biases and tied embeddings."""
    tiny = PlannerShape(**dataclasses.asdict(make_shape()))  # the planner's subclass of the shared shape
    for shape in (tiny, model_from_preset("qwen2.5-0.5b"), model_from_preset("llama3-8b")):
        per_key = 4 * shape.num_hidden_layers * shape.q_dim
        for s in (1, 7, 512):
            planner = s * estimate_forward_flops_per_token(shape, s)
            assert forward_flops(shape, [s]) == pytest.approx(planner + per_key * s / 2, rel=1e-12)


def _matmul_weights(cfg) -> int:
    """Weights of one layer that are multiplied (no norms, no biases)."""
    h = cfg.hidden_size
    return h * cfg.q_dim + 2 * h * cfg.kv_dim + cfg.q_dim * h + 3 * h * cfg.intermediate_size


def _measured_forward(model, ids: torch.Tensor) -> int:
    # torch's CPU fused SDPA kernel has no FLOP formula in FlopCounterMode (it would count 0 for
    # attention); the math backend runs it as two bmm over the whole masked s x s score matrix.
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter, torch.no_grad():
        model(ids)
    return counter.get_total_flops()


@pytest.mark.parametrize("model_type, tied", [("llama", False), ("qwen2", True)])
def test_flop_counter_mode_on_the_policy_model(model_type, tied):
    """Measured = the formula with dense attention, less what the planner counts on norm and bias
    weights (2 FLOPs each per token, elementwise work FlopCounterMode does not count)."""
    cfg = make_decoder_config(model_type=model_type, tie_word_embeddings=tied, attention_bias=model_type == "qwen2",
                              vocab_size=37)
    B, s = 2, 9
    ids = torch.randint(0, cfg.vocab_size, (B, s), generator=torch.Generator().manual_seed(0))
    measured = _measured_forward(make_model(cfg), ids)

    formula = forward_flops(cfg, [s] * B)
    per_key = 4 * cfg.num_hidden_layers * cfg.q_dim
    causal = per_key * B * s * (s + 1) / 2  # what the formula counts: each query against the keys up to itself
    dense = per_key * B * s * s  # what the math backend multiplies: every query against every key
    planner_layer = estimate_layer_parameter_count(model_from_hf_config(cfg.to_hf()))
    elementwise = 2 * (planner_layer - _matmul_weights(cfg)) * cfg.num_hidden_layers * B * s
    assert formula - causal + dense - elementwise == measured
    # The planner's norm and bias weights: 0.8% of this h=32 decoder's weights, 1.5% with qwen2's biases.
    assert abs(formula - causal + dense - measured) / measured < 0.02


def test_backward_is_twice_the_forward_on_the_policy_model():
    """train = 3 x forward: forward + backward of the decoder measure three times its forward."""
    cfg = make_decoder_config()
    model = make_model(cfg)
    ids = torch.randint(0, cfg.vocab_size, (2, 9), generator=torch.Generator().manual_seed(0))
    forward = _measured_forward(model, ids)
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
        model(ids).square().mean().backward()
    assert counter.get_total_flops() == 3 * forward


def test_mfu():
    assert mfu(1e12, 2.0, 1e11, 5) == pytest.approx(1.0)
    assert mfu(3e11, 1.5, 1e11, 2) == pytest.approx(1.0)
    for bad in ((1.0, 0.0, 1e11, 1), (1.0, 1.0, 0.0, 1), (1.0, 1.0, 1e11, 0)):
        with pytest.raises(ValueError):
            mfu(*bad)
