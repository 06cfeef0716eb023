"""The planner's formulas against what the runtime allocates and measures."""

from __future__ import annotations

import pytest
import torch

from conftest import make_decoder_config, make_model
from planner import estimate_kv_cache_bytes, model_from_hf_config
from stages.rollout import SamplingParams, generate


@pytest.mark.parametrize("layers, heads, kv_heads, head_dim, prompts, G, new", [
    (2, 4, 2, 8, 3, 4, 5), (3, 4, 4, 16, 2, 8, 7), (1, 8, 1, 4, 5, 2, 3)])
def test_kv_cache_formula_matches_the_engine_allocation_exactly(layers, heads, kv_heads, head_dim, prompts, G, new):
    cfg = make_decoder_config(num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
                              head_dim=head_dim)
    model = make_model(cfg)
    lengths = [3 + (i % 3) for i in range(prompts)]
    batch = generate(model, [[1] + [4] * (n - 1) for n in lengths],
                     SamplingParams(group_size=G, max_new_tokens=new, stop_ids=(2,)), torch.Generator().manual_seed(0))
    predicted = estimate_kv_cache_bytes(model_from_hf_config(cfg.to_hf()), prompts, G, prompt_len=max(lengths),
                                        gen_len=new, dtype_bytes=4, share_prefix=True)
    assert batch.kv_cache_bytes == predicted
