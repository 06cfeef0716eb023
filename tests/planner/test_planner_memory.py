"""Activation stash, stage parameters and KV cache against hand-worked numbers."""

import dataclasses

import pytest
from hypothesis import given
from hypothesis import strategies as st

from planner.memory import (
    TORCH_EAGER_IMPL,
    ActivationImpl,
    estimate_activation_breakdown,
    estimate_activation_bytes_per_microbatch,
    estimate_kv_cache_bytes,
    estimate_kv_cache_bytes_per_gpu,
    estimate_optimizer_bytes,
    estimate_stage_parameters,
)
from planner.model import estimate_parameter_count, model_from_preset
from stages.layout import MEGATRON_TP, layers_per_stage
from planner_factories import make_gpt_shape, make_model

S, B, H, A = 2048, 2, 1024, 16
PAPER = ActivationImpl(attention="eager", dropout=True, sequence_parallel=False)


def test_gpt_layer_matches_korthikanti_34sbh_plus_5as2b():
    got = estimate_activation_bytes_per_microbatch(make_gpt_shape(H, A), B, S, 1, 2, "none", impl=PAPER)
    assert got == 34 * S * B * H + 5 * A * S * S * B == 813_694_976


def test_tensor_parallel_without_and_with_sequence_parallel_match_the_paper():
    t = 4
    plain = estimate_activation_bytes_per_microbatch(make_gpt_shape(H, A), B, S, 1, 2, "none",
                                                     tensor_parallel_size=t, impl=PAPER)
    assert plain == S * B * H * (10 + 24 // t) + 5 * A * S * S * B // t  # sbh(10 + 24/t + 5as/(ht))
    sp = ActivationImpl(attention="eager", dropout=True, sequence_parallel=True)
    sharded = estimate_activation_bytes_per_microbatch(make_gpt_shape(H, A), B, S, 1, 2, "none",
                                                       tensor_parallel_size=t, impl=sp)
    assert sharded == (34 * S * B * H + 5 * A * S * S * B) // t


def test_selective_recompute_leaves_34sbh_and_full_leaves_the_layer_input():
    gpt = make_gpt_shape(H, A)
    assert estimate_activation_bytes_per_microbatch(gpt, B, S, 3, 2, "selective", impl=PAPER) == 3 * 34 * S * B * H
    assert estimate_activation_bytes_per_microbatch(gpt, B, S, 3, 2, "full", impl=PAPER) == 3 * 2 * S * B * H


def test_llama_layer_itemised_by_hand():
    # Llama-3-70B, 1 x 5120 tokens, TP 4 + SP, flash, no dropout, per token:
    # replicated/4: 2 norm inputs + QKV input + MLP input = 4 * 2 * 8192 / 4 = 16384
    # sharded/4: Q 8192 + K,V 2*1024 + attn out 8192 (x2 B) = 36864; lse 4 * 64;
    # SwiGLU fused (Megatron/TE, the default): fc1 out 2F + down_proj input F = 3 * 2 * 28672 = 172032,
    # eager autograd also keeps silu(gate): 4 * 2 * 28672 = 229376
    model = model_from_preset("llama3-70b")
    fused = estimate_activation_bytes_per_microbatch(model, 1, 5120, 1, 2, "none", tensor_parallel_size=4)
    assert fused == 5120 * (16384 + (36864 + 172032 + 256) / 4)
    eager = estimate_activation_bytes_per_microbatch(model, 1, 5120, 1, 2, "none", tensor_parallel_size=4,
                                                     impl=ActivationImpl(swiglu="eager"))
    assert eager == 5120 * (16384 + (36864 + 229376 + 256) / 4)


def test_last_stage_adds_lm_head_input_and_fp32_log_softmax():
    model = make_model()
    base = estimate_activation_breakdown(model, 2, 128, 3, 2, "none", tensor_parallel_size=2)
    last = estimate_activation_breakdown(model, 2, 128, 3, 2, "none", tensor_parallel_size=2, is_last_stage=True)
    tokens = 256
    assert last.head_bytes == tokens * (2 * 2 * 256 / 2 + 4 * 1000 / 2 + 8)
    assert last.total_bytes == base.total_bytes + last.head_bytes
    first = estimate_activation_breakdown(model, 2, 128, 3, 2, "none", is_first_stage=True)
    assert first.embedding_bytes == tokens * 8


def test_eager_hf_implementation_knobs_add_their_tensors():
    model = make_model()
    flash = estimate_activation_bytes_per_microbatch(model, 1, 64, 1, 4, "none", impl=ActivationImpl(sequence_parallel=False))
    hf = ActivationImpl(attention="eager", rmsnorm="eager", expand_kv=True, sequence_parallel=False)
    eager = estimate_activation_bytes_per_microbatch(model, 1, 64, 1, 4, "none", impl=hf)
    # fp32: each eager norm keeps an fp32 copy (4h) and rstd (4); K,V expanded 2*(256-64)*4; softmax 4*8*64 vs lse 4*8
    assert eager - flash == 64 * (2 * (4 * 256 + 4) + 2 * (256 - 64) * 4 + 4 * 8 * 64 - 4 * 8)


def test_torch_eager_decoder_layer_by_hand():
    # grpoflow's own decoder, fp32, h=64, d=16, 4 heads, 2 KV heads, F=176; per token (bytes), per layer:
    # 2 eager RMSNorms (x 256 + rstd 4 + normalised 256) 1032, QKV and MLP inputs 512, q and repeated k, v 768,
    # log-sum-exp 16, attention output = o_proj input 256, SwiGLU 4*176*4 = 2816; per stage: the rope cos and
    # sin tables its layers share, 2*16*4 = 128
    model = make_model(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                       intermediate_size=176)
    per_layer = 1032 + 512 + 768 + 16 + 256 + 2816
    got = estimate_activation_bytes_per_microbatch(model, 3, 24, 1, 4, "none", impl=TORCH_EAGER_IMPL)
    # 72 tokens x 5528 B, what saved_tensors_hooks measures on stages/policy/model.py
    # (tests/flows/test_planner_vs_runtime.py compares the two on the running pipeline)
    assert got == 72 * (per_layer + 128)
    two_layers = estimate_activation_bytes_per_microbatch(model, 3, 24, 2, 4, "none", impl=TORCH_EAGER_IMPL)
    assert two_layers == 72 * (2 * per_layer + 128)
    masked = estimate_activation_bytes_per_microbatch(
        model, 3, 24, 1, 4, "none", impl=dataclasses.replace(TORCH_EAGER_IMPL, attention="flash-masked"))
    assert masked - got == 3 * 24 * 24 * 4  # the (b, 1, s, s) additive mask SDPA keeps per layer


def test_bad_recompute_mode_is_rejected():
    with pytest.raises(ValueError, match="recompute"):
        estimate_activation_bytes_per_microbatch(make_model(), 1, 8, 1, 2, "sometimes")


def test_kv_cache_shared_prefix_is_the_runtime_allocation():
    model = model_from_preset("llama3-70b")
    # 64 prompts x 1024 prefix tokens + 512 samples x 4096 decode tokens = 2,162,688 tokens x 327,680 B
    assert estimate_kv_cache_bytes(model, 64, 8, 1024, 4096) == 708_669_603_840
    assert estimate_kv_cache_bytes(model, 64, 8, 1024, 4096, share_prefix=False) == 327_680 * 512 * 5120


def test_paged_kv_rounds_each_sample_and_copies_the_partial_prefix_page():
    model = model_from_preset("llama3-70b")
    # prompt 1000 = 62 full pages (992 tokens, shared) + 8 tokens copied into each sample; 8 + 100 -> 7 pages
    got = estimate_kv_cache_bytes(model, 2, 4, 1000, 100, page_size=16)
    assert got == 327_680 * (2 * 992 + 8 * 112)


@given(prompts=st.integers(1, 64), group=st.integers(1, 16), prompt_len=st.integers(1, 4096),
       gen_len=st.integers(1, 4096), page=st.sampled_from([1, 8, 16, 256]))
def test_paging_never_allocates_less_than_exact_and_sharing_never_more(prompts, group, prompt_len, gen_len, page):
    model = make_model()
    exact = estimate_kv_cache_bytes(model, prompts, group, prompt_len, gen_len)
    assert estimate_kv_cache_bytes(model, prompts, group, prompt_len, gen_len, page_size=page) >= exact
    assert estimate_kv_cache_bytes(model, prompts, group, prompt_len, gen_len, share_prefix=False) >= exact


def test_kv_per_gpu_replicates_heads_when_tp_exceeds_kv_heads():
    model = make_model(num_key_value_heads=2)
    assert estimate_kv_cache_bytes_per_gpu(1000.0, model, 2) == 500.0
    assert estimate_kv_cache_bytes_per_gpu(1000.0, model, 8) == 500.0  # one (replicated) head per rank


def test_stage_parameters_sum_to_the_model_without_tp():
    model = model_from_preset("llama3-70b")
    layers = layers_per_stage(80, 8)
    total = sum(estimate_stage_parameters(model, n, has_embedding=s == 0, has_head=s == 7) for s, n in enumerate(layers))
    assert total == estimate_parameter_count(model)


def test_distributed_optimizer_divides_adam_state_by_dp():
    assert estimate_optimizer_bytes(1000, 4, True) == 3000
    assert estimate_optimizer_bytes(1000, 4, False) == 12000


def test_embedding_is_replicated_over_tp_by_the_runtime_and_vocab_parallel_under_megatron():
    # Llama-3-70B first stage of 10 layers at TP 4: per layer (855,654,400 - 2*8192)/4 + 2*8192 sharded/replicated;
    # embedding 128256 * 8192 = 1,050,673,152 whole (runtime) or / 4 (Megatron)
    model = model_from_preset("llama3-70b")
    layers = 10 * ((855_654_400 - 2 * 8192) // 4 + 2 * 8192)
    runtime = estimate_stage_parameters(model, 10, has_embedding=True, has_head=False, tensor_parallel_size=4)
    megatron = estimate_stage_parameters(model, 10, has_embedding=True, has_head=False, tensor_parallel_size=4,
                                         tp_rules=MEGATRON_TP)
    assert runtime == layers + 1_050_673_152 and megatron == layers + 1_050_673_152 // 4
