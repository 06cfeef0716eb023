"""Rollout row assembly and seeding (stages/rollout/rows.py), on hand-built batches and against a
direct engine call."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from stages.config import RolloutConfig
from stages.policy.tokenizer import TextCodec
from stages.rollout import RolloutBatch, SamplingParams, generate
from stages.rollout.contract import RolloutEngine
from stages.rollout.native import NativeEngine
from stages.rollout.rows import cut_at_stop_strings, first_group_id, generate_rows, rollout_rows, rollout_seed
from stages.tasks.addition import make_tokenizer_json
from conftest import make_decoder_config, make_model

_PAD = 0


def make_batch(num_prompts: int = 2, group_size: int = 2, prompt_tokens: int = 3, max_new: int = 4) -> RolloutBatch:
    n = num_prompts * group_size
    rng = np.random.default_rng(0)
    return RolloutBatch(
        prompt_ids=rng.integers(3, 9, (n, prompt_tokens)).astype(np.int32),
        prompt_len=np.full(n, prompt_tokens, np.int32),
        tokens=rng.integers(3, 9, (n, max_new)).astype(np.int32),
        length=np.minimum(np.arange(1, n + 1), max_new).astype(np.int32),
        behav_logp=-rng.random((n, max_new)).astype(np.float32),
        finish_reason=np.zeros(n, np.int8), kv_cache_bytes=1024, seconds=0.5)


def test_seed_and_group_ids_are_the_documented_mixes():
    # 2 * 1_000_003 + 3 * 1_009 + 4, worked by hand.
    assert rollout_seed(2, 3, 4) == 2_003_037
    assert rollout_seed(0, 0, 0) == 0 and rollout_seed(0, 0, 4) != rollout_seed(0, 1, 0)
    assert first_group_id(step=3, prompts_per_step=4, prompt_start=2) == 14


def test_rows_pad_prompts_and_number_groups():
    batch = make_batch()  # 2 prompts x G 2, prompts of 3 tokens, lengths 1, 2, 3, 4
    rows = rollout_rows(batch, prompt_width=5, pad_id=_PAD, first_group=14, group_size=2, policy_version=7,
                        row_start=4)
    a = rows.arrays
    assert rows.row_start == 4 and rows.num_rows == 4
    assert a["prompt_ids"].shape == (4, 5) and a["prompt_ids"].dtype == np.int32
    np.testing.assert_array_equal(a["prompt_ids"][:, :3], batch.prompt_ids)
    assert np.all(a["prompt_ids"][:, 3:] == _PAD)
    np.testing.assert_array_equal(a["group_id"], [14, 14, 15, 15])
    np.testing.assert_array_equal(a["policy_version"], [7, 7, 7, 7])
    assert rows.metrics["rollout_tokens"] == 10.0  # 1 + 2 + 3 + 4
    assert rows.metrics["rollout_tokens_per_s"] == pytest.approx(20.0)  # 10 tokens in 0.5 s
    assert rows.metrics["kv_cache_bytes"] == 1024.0
    assert set(a) == {"prompt_ids", "prompt_len", "tokens", "length", "behav_logp", "finish_reason", "group_id",
                      "policy_version"}


def test_a_prompt_wider_than_the_step_is_refused():
    with pytest.raises(ValueError, match="prompt width 2"):
        rollout_rows(make_batch(prompt_tokens=3), prompt_width=2, pad_id=_PAD, first_group=0, group_size=2,
                     policy_version=0)


def test_generate_rows_equals_a_direct_engine_call():
    codec = TextCodec.from_json(make_tokenizer_json())
    model = make_model(make_decoder_config(vocab_size=codec.vocab_size, bos_token_id=codec.bos_id,
                                           eos_token_id=codec.eos_id, pad_token_id=codec.pad_id))
    cfg = RolloutConfig(group_size=3, max_new_tokens=4, temperature=1.3)
    prompts = ["12+7=", "3+45="]
    ids = [[codec.bos_id, *codec.encode(p)] for p in prompts]
    engine = RolloutEngine(NativeEngine(model=model), version=1)
    rows = generate_rows(engine, codec, ids, cfg, seed=5, step=2, prompt_start=6, prompts_per_step=8,
                         prompt_width=7, policy_version=1)
    # The reference: the engine called by hand with the seed formula written out.
    params = SamplingParams(3, 4, 1.3, 1.0, (codec.eos_id,), codec.pad_id)
    direct = generate(model, ids, params, torch.Generator().manual_seed(5 * 1_000_003 + 2 * 1_009 + 6))
    for name in ("tokens", "length", "behav_logp", "finish_reason", "prompt_len"):
        np.testing.assert_array_equal(rows.arrays[name], getattr(direct, name), err_msg=name)
    assert rows.row_start == 18  # prompt 6 x G 3
    np.testing.assert_array_equal(rows.arrays["group_id"], [22, 22, 22, 23, 23, 23])  # 2 x 8 + 6
    np.testing.assert_array_equal(rows.arrays["prompt_ids"][0], [codec.bos_id, *codec.encode("12+7="), codec.pad_id])


def test_stop_strings_end_a_completion_at_the_token_that_completes_them():
    """rollout.stop: the completion ends at its first token whose text completes a stop string (kept,
    as a stop token is); the log-probs before it stay, everything after becomes padding."""
    codec = TextCodec.from_json(make_tokenizer_json())
    ids = lambda text: codec.encode(text)  # noqa: E731 (one id per character)
    rows = [ids("12+34"), ids("9="), ids("=1+2=")]
    batch = make_batch(num_prompts=3, group_size=1, max_new=5)
    for r, row in enumerate(rows):
        batch.tokens[r] = 0
        batch.tokens[r, : len(row)] = row
        batch.length[r] = len(row)
        batch.finish_reason[r] = 1
    cut = cut_at_stop_strings(batch, codec, ["+3", "="])
    assert cut.length.tolist() == [4, 2, 1]  # "12+3" (the stop spans two tokens), "9=", "="
    assert cut.finish_reason.tolist() == [0, 0, 0]
    np.testing.assert_array_equal(cut.tokens[0], ids("12+3") + [0])
    np.testing.assert_array_equal(cut.behav_logp[0, :4], batch.behav_logp[0, :4])
    assert (cut.behav_logp[0, 4:] == 0).all() and (cut.behav_logp[2, 1:] == 0).all()
    untouched = cut_at_stop_strings(batch, codec, ["99"])  # no completion holds it
    np.testing.assert_array_equal(untouched.tokens, batch.tokens)
    assert untouched.finish_reason.tolist() == [1, 1, 1]
    assert cut_at_stop_strings(batch, codec, []) is batch
