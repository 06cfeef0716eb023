"""Model shapes: exact parameter counts and KV bytes from HF configs."""

import pytest

from planner.model import (
    estimate_forward_flops_per_token,
    estimate_kv_bytes_per_token,
    estimate_layer_parameter_count,
    estimate_parameter_count,
    model_from_hf_config,
    model_from_preset,
)
from planner_factories import make_model

LLAMA3_70B_CONFIG = {  # the fields of meta-llama/Meta-Llama-3-70B config.json that shape the model
    "hidden_size": 8192, "num_hidden_layers": 80, "num_attention_heads": 64, "num_key_value_heads": 8,
    "intermediate_size": 28672, "vocab_size": 128256, "tie_word_embeddings": False, "attention_bias": False,
    "model_type": "llama",
}


def test_llama3_70b_parameter_count_is_exact():
    model = model_from_hf_config(LLAMA3_70B_CONFIG)
    # embed 128256*8192 + 80 * (q,o 2*8192^2 + k,v 2*8192*1024 + MLP 3*8192*28672 + norms 2*8192) + norm + lm_head
    assert estimate_layer_parameter_count(model) == 855_654_400
    assert estimate_parameter_count(model) == 70_553_706_496


def test_llama3_70b_kv_bytes_per_token():
    # 2 (K, V) * 80 layers * 8 KV heads * 128 head_dim * 2 bytes
    assert estimate_kv_bytes_per_token(model_from_hf_config(LLAMA3_70B_CONFIG)) == 327_680


@pytest.mark.parametrize(("preset", "params"), [
    ("llama3-8b", 8_030_261_248),
    ("qwen2-7b", 7_615_616_512),       # q/k/v biases (model_type qwen2)
    ("qwen2.5-0.5b", 494_032_768),     # tied embeddings
    ("qwen2.5-72b", 72_706_203_648),
])
def test_published_parameter_counts(preset, params):
    assert estimate_parameter_count(model_from_preset(preset)) == params


def test_qwen2_bias_and_tying_change_the_count_by_hand_worked_amounts():
    untied = model_from_hf_config({**LLAMA3_70B_CONFIG, "tie_word_embeddings": True})
    assert estimate_parameter_count(untied) == 70_553_706_496 - 128256 * 8192
    biased = model_from_hf_config({**LLAMA3_70B_CONFIG, "model_type": "qwen2", "attention_bias": None})
    assert estimate_parameter_count(biased) - 70_553_706_496 == 80 * (8192 + 2 * 1024)


def test_head_dim_defaults_to_hidden_over_heads_and_can_be_set():
    assert model_from_hf_config(LLAMA3_70B_CONFIG).head_dim == 128
    wide = model_from_hf_config({**LLAMA3_70B_CONFIG, "head_dim": 256})
    assert wide.q_dim == 64 * 256 and estimate_kv_bytes_per_token(wide) == 2 * 80 * 8 * 256 * 2


def test_missing_key_names_the_key():
    broken = dict(LLAMA3_70B_CONFIG)
    del broken["vocab_size"]
    with pytest.raises(ValueError, match="vocab_size"):
        model_from_hf_config(broken)


def test_unknown_preset_lists_known_ones():
    with pytest.raises(ValueError, match="llama3-70b"):
        model_from_preset("llama9-1t")


def test_forward_flops_per_token_hand_worked():
    model = make_model()
    matmul = 4 * (estimate_layer_parameter_count(model) - 2 * 256) + 1000 * 256  # the norms do no matmul
    flops = estimate_forward_flops_per_token(model, context_len=100)
    # 2 FLOPs per matmul weight (here norm weights are counted as in 2N) + causal attention 4*L*q_dim*s/2
    assert flops == 2.0 * (4 * estimate_layer_parameter_count(model) + 1000 * 256) + 4 * 4 * 256 * 100 * 0.5
    assert flops > 2.0 * matmul
