"""What auto picks for the training layout (stages/train/auto.py), worked out by hand for the
tiny config, the bench shape and the SmolLM2 config, and train_setup's chunk size."""

from __future__ import annotations

import json

import pytest

from stages.config import ModelConfig, TrainConfig
from stages.policy.tokenizer import TextCodec
from stages.tasks.tiny_policy import tiny_decoder_config
from stages.train.setup import train_setup
from stages.tasks.addition import make_tokenizer_json, vocab_size
from stages.train.auto import auto_length_buckets, auto_logprob_chunk_tokens, auto_packing


@pytest.mark.parametrize("prompt_width, max_new_tokens, expected", [
    (7, 6, None),  # tiny: S = 13 < 2 x 16, one pass shaped for the worst case
    (7, 64, (16, 32, 71)),  # bench: 64 > 71 / 2 drops out, S last
    (96, 48, (16, 32, 64, 144)),  # SmolLM2: 128 > 144 / 2 drops out
    (7, 24, None),  # S = 31: 16 > 31 / 2
    (7, 25, (16, 32)),  # S = 32: the first S with a bucket below it
    (32, 32, (16, 32, 64)),  # S a power of two: S / 2 is the last narrower width
])
def test_auto_length_buckets_by_hand(prompt_width, max_new_tokens, expected):
    assert auto_length_buckets(prompt_width, max_new_tokens) == expected


@pytest.mark.parametrize("prompt_width, max_new_tokens, budget, share, expected", [
    (96, 48, 576, 0.0469, (16, 32, 64, 144, 288)),  # SmolLM2 at micro_batch_size 4: two 288-wide rows
    (96, 48, 288, 0.0469, (16, 32, 64, 144, 288)),  # a budget of exactly one 2S row
    (96, 48, 287, 0.0469, (16, 32, 64, 144)),  # the budget holds no 2S row
    (7, 64, 568, 0.0251, (16, 32, 71, 142)),  # bench, micro_batch_size 8
    (96, 48, 576, 0.10, (16, 32, 64, 144, 288)),  # the limit itself
    (96, 48, 576, 0.1001, (16, 32, 64, 144)),  # attention too dear against the layers
    (96, 48, None, 0.0469, (16, 32, 64, 144)),  # no budget, no share: S last, as above
    (96, 48, 576, None, (16, 32, 64, 144)),
    (7, 6, 832, 0.001, None),  # tiny: no buckets at all
])
def test_auto_length_buckets_add_a_packed_2s_row_where_it_is_cheap(prompt_width, max_new_tokens, budget, share,
                                                                    expected):
    assert auto_length_buckets(prompt_width, max_new_tokens, budget=budget, attention_share=share) == expected


def test_attention_share_by_hand():
    """K * keys / W with K = 4 L q_dim and W = 2 L (layer weights), SmolLM2-135M's shape: q_dim =
    9 x 64 = 576; a layer's weights q 576^2, k and v 576 x 192 each, o 576^2, the MLP 3 x 576 x
    1,536, and two RMSNorms of 576 (the planner counts them too): 3,540,096."""
    from stages.layout import ModelShape
    from stages.perf.flops import attention_share

    shape = ModelShape(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                       num_key_value_heads=3, head_dim=64, vocab_size=49152)
    layer = 2 * 576 * 576 + 2 * 576 * 192 + 3 * 576 * 1536 + 2 * 576
    assert layer == 3_540_096
    assert attention_share(shape, 144) == pytest.approx(4 * 576 * 144 / (2 * layer), rel=1e-12)


def test_auto_packing_needs_buckets_or_a_row_width():
    assert auto_packing(None, None) is False  # tiny: the worst-case layout, padded
    assert auto_packing((16, 32, 71), None) is True  # bench: rows of each bucket's width
    assert auto_packing(None, 26) is True  # train.pack_row_tokens asks for packed rows


@pytest.mark.parametrize("vocab, expected", [(15, None), (8191, None), (8192, 256), (49_152, 256), (151_936, 256)])
def test_auto_logprob_chunk_tokens_by_vocabulary(vocab, expected):
    # 15: the addition tokenizer; 49,152: SmolLM2; 151,936: Qwen2.
    assert auto_logprob_chunk_tokens(vocab) == expected


def test_addition_vocab_size_is_the_tokenizers():
    assert vocab_size() == len(json.loads(make_tokenizer_json())["model"]["vocab"]) == 15


@pytest.mark.parametrize("model_vocab, section, given, expected", [
    (None, "auto", None, None),  # the tiny vocabulary: full logits
    (49_152, "auto", None, 256),  # auto resolved for the model's vocabulary
    (49_152, None, None, None),  # explicit unset wins over the vocabulary
    (None, 64, None, 64),  # the section's own number
    (49_152, "auto", 128, 128),  # the caller's resolved value (GRPOConfig.logprob_chunk_tokens)
])
def test_train_setup_takes_the_resolved_chunk_size(model_vocab, section, given, expected):
    codec = TextCodec.from_json(make_tokenizer_json())
    model = tiny_decoder_config(ModelConfig(vocab_size=model_vocab), codec, max_positions=13)
    setup = train_setup(TrainConfig(logprob_chunk_tokens=section), model, 2, 1.0, logprob_chunk_tokens=given)
    assert setup.logprob_chunk_tokens == expected
