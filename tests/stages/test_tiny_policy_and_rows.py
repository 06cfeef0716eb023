"""The tiny base policy (stages/tasks/tiny_policy.py) and the rows' rewards (stages/reward/rows.py)
on small fixtures, against hand-worked numbers and transformers."""

from __future__ import annotations

import numpy as np
import pytest
import transformers  # a test dependency: the tiny model's config must load there

from stages.config import ModelConfig, RewardConfig, WarmupConfig
from stages.data import PromptRecord
from stages.policy import DecoderConfig
from stages.policy.tokenizer import TextCodec
from stages.reward.rows import decode_rows, reward_statistics, score_rows
from stages.tasks.tiny_policy import tiny_base_policy, tiny_decoder_config, tiny_max_positions
from stages.tasks.addition import make_tokenizer_json


def test_reward_statistics_hand_worked():
    reward = np.array([1, 0, 1, 1, 0, 0, 0, 0], np.float32)  # two groups of G = 4; the second all 0
    length = np.array([2, 4, 4, 2, 6, 6, 1, 3], np.int32)
    stats = reward_statistics(reward, length, group_size=4)
    assert stats["reward_mean"] == 0.375  # 3 / 8
    assert stats["reward_std"] == pytest.approx(0.234375 ** 0.5)  # E[r^2] - E[r]^2 = 3/8 - 9/64
    assert stats["zero_variance_groups"] == 1.0
    assert stats["completion_length_mean"] == 3.5  # 28 / 8
    with pytest.raises(ValueError, match="groups of 3"):
        reward_statistics(reward, length, group_size=3)


@pytest.mark.parametrize("num_digits, max_new, expected", [
    (2, 6, 13),  # "<bos>99+99=" is 7 tokens; 6 sampled tokens
    (2, 2, 11),  # the warm-up's "198<eos>" (4 tokens) is longer than 2 sampled ones
    (1, 3, 8),   # "<bos>9+9=" 5 tokens + 3
])
def test_tiny_max_positions_is_the_longest_sequence(num_digits, max_new, expected):
    assert tiny_max_positions(num_digits, max_new) == expected


def test_tiny_decoder_config_maps_the_model_section_and_loads_in_transformers():
    codec = TextCodec.from_json(make_tokenizer_json())
    model = ModelConfig(model_type="qwen2", hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2)
    cfg = tiny_decoder_config(model, codec, max_positions=13)
    assert (cfg.vocab_size, cfg.head_dim, cfg.max_position_embeddings) == (15, 8, 13)
    assert cfg.attention_bias and (cfg.bos_token_id, cfg.eos_token_id, cfg.pad_token_id) == (1, 2, 0)
    hf = transformers.AutoConfig.for_model(**cfg.to_hf())
    assert hf.max_position_embeddings == 13 and hf.num_key_value_heads == 2
    assert DecoderConfig.from_hf(cfg.to_hf()) == cfg


def test_tiny_base_policy_records_its_real_max_positions():
    policy = tiny_base_policy(ModelConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                                          num_attention_heads=2, num_key_value_heads=1),
                              WarmupConfig(steps=1, batch_size=4), num_digits=2, max_new_tokens=6, seed=0)
    assert policy.hf_config["max_position_embeddings"] == 13
    assert policy.tokenizer_json == make_tokenizer_json()
    assert "model.embed_tokens.weight" in policy.tensors


def test_decode_and_score_stored_rows():
    codec = TextCodec.from_json(make_tokenizer_json())
    prompts, answers = ["12+7=", "3+45="], ["19", "47"]  # the second answer is wrong (48)
    width, new = 7, 4
    rows = {"prompt_ids": np.full((2, width), codec.pad_id, np.int32), "prompt_len": np.zeros(2, np.int32),
            "tokens": np.full((2, new), codec.pad_id, np.int32), "length": np.zeros(2, np.int32)}
    for i, (p, a) in enumerate(zip(prompts, answers)):
        ids, out = [codec.bos_id, *codec.encode(p)], [*codec.encode(a), codec.eos_id]
        rows["prompt_ids"][i, : len(ids)], rows["prompt_len"][i] = ids, len(ids)
        rows["tokens"][i, : len(out)], rows["length"][i] = out, len(out)
    assert decode_rows(codec, rows) == (prompts, answers)
    records = [PromptRecord(i, p, tuple(rows["prompt_ids"][i, :rows["prompt_len"][i]]), str(eval_sum))
               for i, (p, eval_sum) in enumerate(zip(prompts, (19, 48)))]
    completions = {k: rows[k] for k in ("tokens", "length")}  # all a scoring task reads of the step
    scored = score_rows(codec, completions, records, 1, RewardConfig(functions=["exact_match"], timeout_s=5.0))
    np.testing.assert_array_equal(scored.reward, [1.0, 0.0])
    assert not scored.failed.any()


def test_reward_statistics_leave_failed_samples_out():
    # G = 4. Group 0: 1, 0, failed, 1 -> scored 1, 0, 1; group 1: three failed, one 1 -> untrained.
    reward = np.array([1, 0, 0, 1, 0, 0, 0, 1], np.float32)
    failed = np.array([0, 0, 1, 0, 1, 1, 1, 0], bool)
    length = np.full(8, 2, np.int32)
    stats = reward_statistics(reward, length, 4, failed)
    assert stats["reward_mean"] == 0.75  # (1 + 0 + 1 + 1) / 4 scored samples
    assert stats["reward_failed"] == 4.0 and stats["untrained_groups"] == 1.0
    assert stats["zero_variance_groups"] == 0.0  # group 0 spreads; group 1 is not trained at all
