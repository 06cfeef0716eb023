"""The planner's paged KV model, checked against numbers worked out by hand."""

from __future__ import annotations

import pytest

from planner import estimate_kv_cache_bytes, model_from_hf_config
from planner.rollout import estimate_paged_kv_blocks, estimate_paged_kv_bytes

_HF = dict(model_type="llama", vocab_size=32, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
           num_attention_heads=4, num_key_value_heads=2, head_dim=16)


def test_shared_prompt_blocks_count_once_per_group_and_samples_round_their_own_tokens():
    # Group 0: prompt 37 = 2 full 16-token blocks (shared) + 5 tokens copied into each sample;
    #   completions of 1, 12, 28 tokens hold 5+0, 5+11, 5+27 tokens -> 1, 1, 2 blocks.
    # Group 1: prompt 32 = 2 full blocks, no partial; completions 1, 17 -> 0, 1 blocks.
    assert estimate_paged_kv_blocks([37, 32], [[1, 12, 28], [1, 17]], 16) == (2 + 1 + 1 + 2) + (2 + 0 + 1)


def test_bytes_are_blocks_times_block_bytes():
    model = model_from_hf_config(_HF)
    per_token = 2 * 3 * 2 * 16 * 2  # K and V x layers x kv heads x head_dim x bf16
    assert estimate_paged_kv_bytes(model, [37, 32], [[1, 12, 28], [1, 17]], 16) == 9 * 16 * per_token


def test_uniform_lengths_stay_within_the_capacity_formula():
    """The capacity estimate reserves the final token's slot too, so it bounds the exact count by <= 1 page/sample."""
    model = model_from_hf_config(_HF)
    for prompt_len, gen_len, page in ((37, 28, 16), (32, 16, 16), (5, 1, 4), (100, 64, 7)):
        exact = estimate_paged_kv_bytes(model, [prompt_len] * 3, [[gen_len] * 4] * 3, page)
        cap = estimate_kv_cache_bytes(model, 3, 4, prompt_len, gen_len, page_size=page)
        assert exact <= cap <= exact + 3 * 4 * page * 2 * 3 * 2 * 16 * 2


def test_mismatched_groups_are_refused():
    with pytest.raises(ValueError, match="groups"):
        estimate_paged_kv_blocks([3, 4], [[1]], 4)
