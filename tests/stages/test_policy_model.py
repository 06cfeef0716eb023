"""The policy decoder against transformers' Llama / Qwen2, its pipeline split, and the tokenizer."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from conftest import random_hf_model
import transformers  # a test dependency: the parity tests fail, never skip, without it
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from stages.layout.shape import RopeScaling
from stages.policy import (DecoderConfig, build_stage, hf_state, layer_ranges, load_hf_state,
                           stage_hf_names)
from stages.policy.tokenizer import TextCodec
from stages.tasks.addition import SPECIALS, answer_of, make_prompts, make_tokenizer_json

_PARITY_ATOL = 1e-4  # fp32 logits of two implementations of the same maths
_WEIGHT_STD = 0.2  # large enough that attention and the MLP are far from their zero-init behaviour



def make_cfg(**overrides) -> DecoderConfig:
    fields = dict(vocab_size=37, hidden_size=32, intermediate_size=48, num_hidden_layers=3,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=8, rope_theta=500.0,
                  rms_norm_eps=1e-5, tie_word_embeddings=False, attention_bias=False,
                  model_type="llama")
    fields.update(overrides)
    if fields["model_type"] == "qwen2":
        fields["attention_bias"] = True  # Qwen2 always carries q/k/v bias
    return DecoderConfig(**fields)


def make_hf_model(cfg: DecoderConfig, seed: int = 0) -> torch.nn.Module:
    """transformers' model for ``cfg`` with EVERY tensor random (HF init leaves biases at zero
    and norm weights at one, which would hide a missing bias or norm)."""
    hf_config = transformers.AutoConfig.for_model(**cfg.to_hf())
    model = random_hf_model(hf_config, seed, _WEIGHT_STD)
    return model.eval()


def make_ids(cfg: DecoderConfig, batch: int = 2, length: int = 9, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, cfg.vocab_size, (batch, length), generator=torch.Generator().manual_seed(seed))


def ours_from_hf(cfg: DecoderConfig, hf_model, stage: int = 0, num_stages: int = 1):
    model = build_stage(cfg, stage, num_stages)
    model.init_weights(torch.Generator().manual_seed(99))  # anything but the HF values
    load_hf_state(model, hf_model.state_dict())
    return model.eval()


def assert_parity(cfg: DecoderConfig, seed: int = 0) -> None:
    hf_model = make_hf_model(cfg, seed)
    ours = ours_from_hf(cfg, hf_model)
    # load_hf_state ignores tensors the stage lacks, so check that none is left behind.
    hf_names = set(hf_model.state_dict()) - ({"lm_head.weight"} if cfg.tie_word_embeddings else set())
    assert set(stage_hf_names(ours)) == hf_names
    ids = make_ids(cfg, seed=seed)
    with torch.no_grad():
        expected = hf_model(ids).logits
        actual = ours(ids)
    assert actual.shape == expected.shape == (*ids.shape, cfg.vocab_size)
    assert (actual - expected).abs().max().item() <= _PARITY_ATOL


# -- parity with transformers ------------------------------------------------------------------
@pytest.mark.parametrize("overrides", [
    pytest.param(dict(), id="llama-gqa"),
    pytest.param(dict(num_key_value_heads=4, head_dim=8), id="llama-mha"),
    pytest.param(dict(head_dim=12), id="llama-head_dim-not-hidden/heads"),
    pytest.param(dict(tie_word_embeddings=True), id="llama-tied"),
    pytest.param(dict(attention_bias=True), id="llama-attention_bias"),
    pytest.param(dict(attention_bias=True, tie_word_embeddings=True, num_key_value_heads=1),
                 id="llama-bias-tied-mqa"),
    pytest.param(dict(model_type="qwen2"), id="qwen2-gqa"),
    pytest.param(dict(model_type="qwen2", tie_word_embeddings=True, head_dim=16), id="qwen2-tied"),
])
def test_logits_match_transformers(overrides):
    assert_parity(make_cfg(**overrides))


_LLAMA31_ROPE = RopeScaling(factor=4.0, low_freq_factor=1.0, high_freq_factor=3.0, original_max_position_embeddings=8)


@pytest.mark.parametrize("overrides", [
    pytest.param(dict(model_type="qwen3"), id="qwen3-gqa"),
    pytest.param(dict(model_type="qwen3", attention_bias=True, tie_word_embeddings=True, head_dim=12),
                 id="qwen3-bias-tied"),
    pytest.param(dict(rope_scaling=_LLAMA31_ROPE, rope_theta=10000.0), id="llama3.1-rope"),
    pytest.param(dict(model_type="qwen3", rope_scaling=_LLAMA31_ROPE, rope_theta=10000.0), id="qwen3-llama3.1-rope"),
])
def test_qwen3_and_llama31_rope_logits_match_transformers(overrides):
    """transformers built from to_hf(): 24 tokens run past the original context of 8."""
    cfg = make_cfg(**overrides)
    hf_model = make_hf_model(cfg)
    ours = ours_from_hf(cfg, hf_model)
    assert set(stage_hf_names(ours)) == set(hf_model.state_dict()) - (
        {"lm_head.weight"} if cfg.tie_word_embeddings else set())
    ids = make_ids(cfg, length=24)
    with torch.no_grad():
        assert (ours(ids) - hf_model(ids).logits).abs().max().item() <= _PARITY_ATOL


def test_qwen3_pipeline_stages_in_sequence_equal_the_full_model():
    cfg = make_cfg(num_hidden_layers=3, model_type="qwen3")
    hf_model = make_hf_model(cfg, seed=4)
    ids = make_ids(cfg, seed=4)
    with torch.no_grad():
        x = ids
        for s in range(3):
            x = ours_from_hf(cfg, hf_model, s, 3)(x)
        assert (x - hf_model(ids).logits).abs().max().item() <= _PARITY_ATOL


@st.composite
def _configs(draw) -> DecoderConfig:
    kv_heads = draw(st.integers(1, 3))
    heads = kv_heads * draw(st.integers(1, 3))
    return make_cfg(
        vocab_size=draw(st.integers(5, 50)),
        hidden_size=heads * draw(st.integers(1, 4)),  # transformers wants heads | hidden
        intermediate_size=draw(st.integers(4, 40)),
        num_hidden_layers=draw(st.integers(1, 3)),
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=draw(st.sampled_from([2, 4, 6, 10])),
        rope_theta=draw(st.sampled_from([100.0, 10000.0, 1e6])),
        tie_word_embeddings=draw(st.booleans()),
        attention_bias=draw(st.booleans()),
        model_type=draw(st.sampled_from(["llama", "qwen2"])),
    )


@settings(max_examples=15, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow])
@given(cfg=_configs(), seed=st.integers(0, 2**16))
def test_logits_match_transformers_on_random_configs(cfg, seed):
    assert_parity(cfg, seed)


def test_hf_config_round_trip():
    for cfg in (make_cfg(), make_cfg(model_type="qwen2", tie_word_embeddings=True),
                make_cfg(attention_bias=True, bos_token_id=1, eos_token_id=2, pad_token_id=0)):
        assert DecoderConfig.from_hf(cfg.to_hf()) == cfg


def test_from_hf_rejects_unsupported_configs():
    with pytest.raises(ValueError, match="model_type"):
        DecoderConfig.from_hf({**make_cfg().to_hf(), "model_type": "mistral"})
    with pytest.raises(ValueError, match="RoPE scaling"):
        DecoderConfig.from_hf({**make_cfg().to_hf(), "rope_scaling": {"rope_type": "linear", "factor": 2.0}})


def test_from_hf_reads_a_transformers5_config():
    hf_dict = transformers.AutoConfig.for_model(**make_cfg(rope_theta=500.0).to_hf()).to_dict()
    assert DecoderConfig.from_hf(hf_dict).rope_theta == 500.0


def test_load_hf_state_names_the_missing_or_misshapen_tensor():
    cfg = make_cfg()
    state = hf_state(build_stage(cfg))
    with pytest.raises(ValueError, match="model.norm.weight"):
        load_hf_state(build_stage(cfg), {k: v for k, v in state.items() if k != "model.norm.weight"})
    bad = {**state, "lm_head.weight": torch.zeros(cfg.vocab_size + 1, cfg.hidden_size)}
    with pytest.raises(ValueError, match="lm_head.weight"):
        load_hf_state(build_stage(cfg), bad)


# -- pipeline split ----------------------------------------------------------------------------
@pytest.mark.parametrize("num_layers,num_stages", [(1, 1), (3, 2), (4, 4), (7, 3), (10, 4)])
def test_layer_ranges_cover_every_layer_once(num_layers, num_stages):
    ranges = layer_ranges(num_layers, num_stages)
    assert len(ranges) == num_stages
    assert [i for a, b in ranges for i in range(a, b)] == list(range(num_layers))
    sizes = [b - a for a, b in ranges]
    assert min(sizes) >= 1 and max(sizes) - min(sizes) <= 1
    assert sizes == sorted(sizes, reverse=True)  # earlier stages take the remainder


def test_layer_ranges_by_hand():
    assert layer_ranges(7, 3) == [(0, 3), (3, 5), (5, 7)]


@pytest.mark.parametrize("num_layers,num_stages", [(3, 4), (3, 0), (0, 1), (2, -1)])
def test_impossible_split_raises(num_layers, num_stages):
    with pytest.raises(ValueError, match=f"{num_layers} layers"):
        layer_ranges(num_layers, num_stages)
    with pytest.raises(ValueError):
        build_stage(make_cfg(num_hidden_layers=num_layers), 0, num_stages)


@pytest.mark.parametrize("num_stages", [2, 3, 4])
@pytest.mark.parametrize("tied", [False, True])
def test_pipeline_stages_in_sequence_equal_the_full_model(num_stages, tied):
    cfg = make_cfg(num_hidden_layers=4, tie_word_embeddings=tied, model_type="qwen2")
    hf_model = make_hf_model(cfg, seed=3)
    ids = make_ids(cfg, seed=3)
    with torch.no_grad():
        full = ours_from_hf(cfg, hf_model)(ids)
        x = ids
        stages = [ours_from_hf(cfg, hf_model, s, num_stages) for s in range(num_stages)]
        for s, stage in enumerate(stages):
            x = stage(x)
            expected_shape = (*ids.shape, cfg.vocab_size if s == num_stages - 1 else cfg.hidden_size)
            assert x.shape == expected_shape
    assert (x - full).abs().max().item() <= 1e-5
    # The stages hold every HF tensor between them, each layer on exactly one stage.
    names = [n for stage in stages for n in stage_hf_names(stage)]
    expected = set(hf_state(build_stage(cfg)))
    assert set(names) == expected
    layer_names = [n for n in names if n.startswith("model.layers.")]
    assert len(layer_names) == len(set(layer_names))


def test_return_hidden_gives_normed_hidden_states():
    cfg = make_cfg()
    model = ours_from_hf(cfg, make_hf_model(cfg))
    hidden_model = build_stage(cfg, return_hidden=True)
    load_hf_state(hidden_model, hf_state(model))
    ids = make_ids(cfg)
    with torch.no_grad():
        hidden = hidden_model(ids)
        assert hidden.shape == (*ids.shape, cfg.hidden_size)
        assert torch.allclose(model.lm_head(hidden), model(ids), atol=1e-6)


def test_init_weights_is_seeded():
    cfg = make_cfg(attention_bias=True)
    a, b = build_stage(cfg), build_stage(cfg)
    a.init_weights(torch.Generator().manual_seed(5))
    b.init_weights(torch.Generator().manual_seed(5))
    sa, sb = hf_state(a), hf_state(b)
    assert sa.keys() == sb.keys()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    assert torch.equal(sa["model.norm.weight"], torch.ones(cfg.hidden_size))
    q_bias = sa["model.layers.0.self_attn.q_proj.bias"]
    assert torch.equal(q_bias, torch.zeros(cfg.num_attention_heads * cfg.head_dim))


# -- tokenizer -----------------------------------------------------------------------------------
def make_codec() -> TextCodec:
    return TextCodec.from_json(make_tokenizer_json())


def test_special_ids_are_distinct_and_not_characters():
    codec = make_codec()
    specials = {codec.bos_id, codec.eos_id, codec.pad_id}
    assert len(specials) == 3
    char_ids = set(codec.encode("0123456789+="))
    assert len(char_ids) == 12 and not char_ids & specials
    assert codec.vocab_size == len(SPECIALS) + 12


@pytest.mark.parametrize("num_digits", [1, 3, 6])
def test_task_prompts_round_trip(num_digits):
    codec = make_codec()
    prompts = make_prompts(seed=11, step=4, num_prompts=20, num_digits=num_digits)
    assert prompts == make_prompts(seed=11, step=4, num_prompts=20, num_digits=num_digits)
    assert prompts != make_prompts(seed=11, step=5, num_prompts=20, num_digits=num_digits)
    for text in prompts:
        ids = codec.encode(text)
        assert len(ids) == len(text)  # one id per character
        assert codec.decode(ids) == text
        # Specials around a completion vanish on decode.
        answer = answer_of(text)
        full = [codec.bos_id, *ids, *codec.encode(answer), codec.eos_id, codec.pad_id, codec.pad_id]
        assert codec.decode(full) == text + answer


def test_answer_of():
    assert answer_of("674+254=") == "928"
    assert answer_of("0+0=") == "0"


def test_codec_rejects_a_tokenizer_without_the_specials():
    with pytest.raises(ValueError, match="special"):
        TextCodec.from_json(make_tokenizer_json(), bos="<s>")


def test_codec_is_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        make_codec().pad_id = 5
