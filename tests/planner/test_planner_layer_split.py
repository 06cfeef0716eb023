"""The planner's layer split: the head's weight worked by hand, the stage model following the split,
and the report naming it."""

import dataclasses

import pytest

from planner.config import PlanConfigError
from planner.loader import load_plan_config
from planner.model import ModelShape
from planner.plan import build_plan
from planner.report import render_report
from planner.training import estimate_head_layers, estimate_stage_layout, estimate_train_step
from planner_factories import SEED_CONFIG, make_plan_config

SMOLLM2 = ModelShape(name="smollm2-135m", vocab_size=49152, hidden_size=576, intermediate_size=1536,
                     num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3, head_dim=64,
                     tie_word_embeddings=True)


def test_smollm2_head_weighs_eight_layers_with_full_logits():
    # a layer's matmul weights: q, o 2 x 576^2 + k, v 2 x 576 x 192 + MLP 3 x 576 x 1536 = 3,538,944;
    # per token 2 x that + causal attention 4 x 576 x 144 / 2 = 7,243,776 FLOPs; lm_head 2 x 49,152 x 576
    head = 2 * 49152 * 576
    layer = 2 * 3_538_944 + 4 * 576 * 144 // 2
    assert estimate_head_layers(SMOLLM2, 144) == pytest.approx(head / layer)  # 7.82
    # chunked over 48 new tokens: half of them counted, 4 head matmuls a token instead of 3
    assert estimate_head_layers(SMOLLM2, 144, chunked_new_tokens=48) == pytest.approx(head / layer * 4 / 3 * 24 / 144)


def test_the_stage_model_follows_the_split():
    # Llama-3-8B shape on PP 4, s = 768: the head (vocab 128,256) weighs 2.37 layers with full logits; chunked
    # log-probs (the run's auto at this vocabulary) over half of 512 new tokens: x 4/3 x 256 / 768 = 1.06.
    auto = make_plan_config()
    even = make_plan_config(train={"layer_split": [8, 8, 8, 8]})
    assert auto.train.chunked_new_tokens == 512
    assert estimate_head_layers(auto.model_shape, auto.seq_len, chunked_new_tokens=512) == pytest.approx(
        estimate_head_layers(auto.model_shape, auto.seq_len) * 4 / 3 * 256 / 768)
    # work 9 / 8 / 8 / 8.06 against the even split's 8 / 8 / 8 / 9.06
    assert estimate_stage_layout(auto.model_shape, auto.train, auto.seq_len).layers == (9, 8, 8, 7)
    a, e = estimate_train_step(auto), estimate_train_step(even)
    assert a.durations.duration(3, "F") < e.durations.duration(3, "F")  # the head's stage holds fewer layers
    assert a.pipeline_s < e.pipeline_s
    # a variant with another number of stages (schedule rows, the search) uses auto
    other = dataclasses.replace(even, train=dataclasses.replace(even.train, schedule="zbv",
                                                                 virtual_pipeline_model_parallel_size=2))
    assert estimate_stage_layout(other.model_shape, other.train, other.seq_len).layers == (5, 4, 4, 4, 4, 4, 4, 3)


def test_a_split_not_summing_to_the_layers_is_refused():
    with pytest.raises(PlanConfigError, match="holds 31 decoder layers"):
        make_plan_config(train={"layer_split": [8, 8, 8, 7]})


def test_the_report_names_the_split_and_its_rule():
    report = render_report(build_plan(load_plan_config(SEED_CONFIG, ["plan.search.enabled=false"])), "test")
    # Llama-3-70B, 128,256-token vocabulary, chunked log-probs: the head weighs under a layer, the even split
    assert "| layer split | 10/10/10/10/10/10/10/10 (auto: the head weighs ~0.6 decoder layers" in report
