"""The torch generation engine and its prefix-shared KV cache, checked against full forwards."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from stages.policy import DecoderConfig, build_stage
from stages.rollout import FINISH_LENGTH, FINISH_STOP, RolloutBatch, SamplingParams, generate

_LOGP_ATOL = 1e-4  # cached decode vs. one full fp32 forward
_PAD = 0



def make_cfg(**overrides) -> DecoderConfig:
    fields = dict(vocab_size=13, hidden_size=24, intermediate_size=40, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=8, model_type="qwen2",
                  attention_bias=True, rope_theta=1000.0)
    fields.update(overrides)
    return DecoderConfig(**fields)


def make_model(cfg: DecoderConfig | None = None, seed: int = 0, std: float = 0.3):
    model = build_stage(cfg or make_cfg())
    gen = torch.Generator().manual_seed(seed)
    model.init_weights(gen, std=std)
    with torch.no_grad():  # init_weights leaves biases at zero and norms at one: randomise them too
        for name, p in model.named_parameters():
            if name.endswith(".bias") or name.endswith("norm.weight"):
                p.add_(torch.randn(p.shape, generator=gen) * std)
    return model.eval()


def make_prompts(lengths=(3, 6, 1), vocab_size: int = 13, seed: int = 0) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    # Ids from 1 up, so a prompt never contains the pad id and padding is visible.
    return [torch.randint(1, vocab_size, (n,), generator=gen).tolist() for n in lengths]


def make_params(**overrides) -> SamplingParams:
    fields = dict(group_size=3, max_new_tokens=6, temperature=0.7, top_p=1.0, stop_ids=(), pad_id=_PAD)
    fields.update(overrides)
    return SamplingParams(**fields)


def run(model, prompts, params, seed: int = 0) -> RolloutBatch:
    return generate(model, prompts, params, torch.Generator().manual_seed(seed))


def completion(batch: RolloutBatch, row: int) -> list[int]:
    return batch.tokens[row, : batch.length[row]].tolist()


def full_logits(model, ids: list[int]) -> torch.Tensor:
    """[len(ids), V] logits of one unpadded sequence, no cache."""
    with torch.no_grad():
        return model(torch.tensor([ids]))[0]


def test_behaviour_logp_equals_a_full_forward():
    model, prompts = make_model(), make_prompts()
    params = make_params(temperature=0.7, stop_ids=(5,))
    batch = run(model, prompts, params)
    G = params.group_size
    for row in range(len(prompts) * G):
        prompt = prompts[row // G]
        gen = completion(batch, row)
        logits = full_logits(model, prompt + gen)[len(prompt) - 1: -1]  # the ones predicting gen
        expected = torch.log_softmax(logits / params.temperature, dim=-1)[torch.arange(len(gen)), gen]
        got = torch.from_numpy(batch.behav_logp[row, : len(gen)])
        assert (got - expected).abs().max().item() <= _LOGP_ATOL, f"sample={row}"
        assert np.all(batch.behav_logp[row, len(gen):] == 0.0)


def test_behaviour_logp_ignores_top_p_truncation():
    """The stored log-prob is under softmax(logits / T), the distribution the loss evaluates."""
    model, prompts = make_model(seed=1), make_prompts(seed=1)
    params = make_params(temperature=1.3, top_p=0.5)
    batch = run(model, prompts, params)
    row = 4
    prompt, gen = prompts[row // params.group_size], completion(batch, row)
    logits = full_logits(model, prompt + gen)[len(prompt) - 1: -1]
    expected = torch.log_softmax(logits / 1.3, dim=-1)[torch.arange(len(gen)), gen]
    assert torch.allclose(torch.from_numpy(batch.behav_logp[row]), expected, atol=_LOGP_ATOL)


@pytest.mark.parametrize("num_prompts,group_size,max_new", [(3, 4, 5), (1, 1, 1), (2, 8, 3)])
def test_kv_cache_bytes_is_the_prefix_shared_formula(num_prompts, group_size, max_new):
    cfg = make_cfg(num_hidden_layers=3, num_key_value_heads=1, head_dim=6, num_attention_heads=2)
    prompts = make_prompts(lengths=[2 + 3 * i for i in range(num_prompts)])
    width = max(len(p) for p in prompts)
    batch = run(make_model(cfg), prompts, make_params(group_size=group_size, max_new_tokens=max_new))
    dtype_bytes = 4  # fp32
    P, G = num_prompts, group_size
    expected = (2 * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim * dtype_bytes
                * (P * width + P * G * max_new))
    assert batch.kv_cache_bytes == expected


def test_stop_tokens_end_a_sample():
    model, prompts = make_model(seed=2), make_prompts(seed=2)
    stop = 4
    params = make_params(group_size=4, max_new_tokens=8, temperature=1.5, stop_ids=(stop,))
    batch = run(model, prompts, params, seed=3)
    free = run(model, prompts, make_params(group_size=4, max_new_tokens=8, temperature=1.5), seed=3)
    stopped = batch.finish_reason == FINISH_STOP
    assert stopped.any() and (~stopped).any(), "the seed should give samples of both kinds"
    N = params.max_new_tokens
    for row in range(len(prompts) * params.group_size):
        n = int(batch.length[row])
        gen = batch.tokens[row, :n].tolist()
        assert np.all(batch.tokens[row, n:] == _PAD) and np.all(batch.behav_logp[row, n:] == 0.0)
        assert np.all(batch.behav_logp[row, :n] < 0.0)
        if stopped[row]:
            assert gen[-1] == stop and stop not in gen[:-1], f"sample={row}"
        else:
            assert batch.finish_reason[row] == FINISH_LENGTH
            assert n == N and stop not in gen
        # The same seed without stop ids samples the same tokens up to the stop.
        assert free.tokens[row, :n].tolist() == gen
    assert set(np.unique(batch.finish_reason).tolist()) <= {FINISH_STOP, FINISH_LENGTH}
    assert batch.finish_reason.dtype == np.int8


def test_samples_that_never_stop_run_to_max_new_tokens():
    batch = run(make_model(), make_prompts(), make_params(stop_ids=()))
    assert np.all(batch.finish_reason == FINISH_LENGTH)
    assert np.all(batch.length == 6)


def test_every_sample_stopping_at_once_ends_generation():
    cfg = make_cfg()
    params = make_params(max_new_tokens=5, stop_ids=tuple(range(cfg.vocab_size)))
    batch = run(make_model(cfg), make_prompts(), params)
    assert np.all(batch.finish_reason == FINISH_STOP) and np.all(batch.length == 1)
    assert np.all(batch.tokens[:, 1:] == _PAD) and np.all(batch.behav_logp[:, 1:] == 0.0)
    assert np.all(batch.behav_logp[:, 0] < 0.0)


def test_a_fixed_seed_reproduces_the_batch():
    model, prompts, params = make_model(), make_prompts(), make_params(temperature=1.2, stop_ids=(3,))
    a, b = run(model, prompts, params, seed=7), run(model, prompts, params, seed=7)
    for name in ("prompt_ids", "prompt_len", "tokens", "length", "behav_logp", "finish_reason"):
        assert np.array_equal(getattr(a, name), getattr(b, name)), name
    assert a.kv_cache_bytes == b.kv_cache_bytes
    c = run(model, prompts, params, seed=8)
    assert not np.array_equal(a.tokens, c.tokens)


def test_tiny_top_p_is_greedy():
    model, prompts = make_model(seed=4), make_prompts(seed=4)
    params = make_params(top_p=1e-6, temperature=2.0, max_new_tokens=5)
    batch = run(model, prompts, params)
    G = params.group_size
    for row in range(len(prompts) * G):
        prompt, gen = prompts[row // G], completion(batch, row)
        greedy = full_logits(model, prompt + gen)[len(prompt) - 1: -1].argmax(-1).tolist()
        assert gen == greedy, f"sample={row}"
    # Greedy decoding makes the G samples of a prompt identical.
    tokens = batch.tokens.reshape(len(prompts), G, -1)
    assert np.all(tokens == tokens[:, :1])


def test_group_samples_share_their_prompt_rows():
    prompts = make_prompts(lengths=(2, 5, 4))
    params = make_params(group_size=3)
    batch = run(make_model(), prompts, params)
    P, G, width = len(prompts), params.group_size, 5
    assert batch.prompt_ids.shape == (P * G, width) and batch.prompt_ids.dtype == np.int32
    assert batch.tokens.shape == batch.behav_logp.shape == (P * G, params.max_new_tokens)
    for row in range(P * G):
        prompt = prompts[row // G]
        assert batch.prompt_len[row] == len(prompt)
        assert batch.prompt_ids[row, : len(prompt)].tolist() == prompt  # left-aligned
        assert np.all(batch.prompt_ids[row, len(prompt):] == _PAD)
    assert np.array_equal(batch.prompt_ids, np.repeat(batch.prompt_ids[::G], G, axis=0))


def test_generate_refuses_a_pipeline_stage():
    with pytest.raises(ValueError, match="whole model"):
        run(build_stage(make_cfg(), 0, 2), make_prompts(), make_params())
