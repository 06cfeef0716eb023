"""Speculative decoding keeps the target's distribution: chi-square goodness of fit against exact probabilities."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch
from scipy.stats import chisquare

from stages.policy import DecoderConfig, build_stage
from stages.rollout import EngineConfig, SamplingParams, generate
from stages.rollout.sampling import truncated_logprobs
from stages.rollout.speculative import draft_from_target, generate_speculative

_VOCAB = 6
_PROMPT = [1, 4, 2]
_DRAWS = 3000
_P_PASS = 1e-3  # a correct sampler fails this by chance once in a thousand runs (fixed seeds: never here)
_P_FAIL = 1e-6


def make_target(seed: int = 0) -> torch.nn.Module:
    cfg = DecoderConfig(vocab_size=_VOCAB, hidden_size=16, intermediate_size=24, num_hidden_layers=3,
                        num_attention_heads=2, num_key_value_heads=1, head_dim=8)
    model = build_stage(cfg)
    model.init_weights(torch.Generator().manual_seed(seed), std=0.5)
    return model.eval()


def exact_joint(model, temperature: float, n: int) -> dict[tuple[int, ...], float]:
    """P(first n tokens) by full forwards: the distribution plain sampling draws from."""
    out = {}
    with torch.no_grad():
        for seq in itertools.product(range(_VOCAB), repeat=n):
            logits = model(torch.tensor([_PROMPT + list(seq)]))[0, len(_PROMPT) - 1: -1]
            logp = torch.log_softmax(logits.double() / temperature, -1)
            out[seq] = float(logp[torch.arange(n), list(seq)].sum().exp())
    return out


def chi_square_p(tokens: np.ndarray, probs: dict[tuple[int, ...], float]) -> float:
    counts = {key: 0 for key in probs}
    for row in tokens:
        counts[tuple(int(t) for t in row)] += 1
    keys = sorted(probs, key=probs.get, reverse=True)
    observed, expected = np.array([counts[k] for k in keys], float), np.array([probs[k] for k in keys]) * len(tokens)
    # Merge the rarest bins into one so every expected count is >= 5 (the chi-square approximation).
    big = expected >= 5
    obs = np.append(observed[big], observed[~big].sum())
    exp = np.append(expected[big], expected[~big].sum())
    return float(chisquare(obs, exp * obs.sum() / exp.sum()).pvalue)


@pytest.fixture(scope="module")
def setup():
    target = make_target()
    draft = draft_from_target(target, 1)
    params = SamplingParams(group_size=_DRAWS, max_new_tokens=3, temperature=1.0)
    return target, draft, params, exact_joint(target, 1.0, 3)


@pytest.mark.parametrize("k", [1, 2])
def test_speculative_samples_follow_the_target_distribution(setup, k):
    target, draft, params, joint = setup
    batch, stats = generate_speculative(target, draft, [_PROMPT], params, torch.Generator().manual_seed(k), k,
                                        EngineConfig(max_num_seqs=_DRAWS))
    assert 0.05 < stats.acceptance < 0.95, "the draft must disagree with the target sometimes for a real test"
    assert chi_square_p(batch.tokens, joint) > _P_PASS


def test_plain_sampling_follows_the_same_distribution(setup):
    target, _, params, joint = setup
    batch = generate(target, [_PROMPT], params, torch.Generator().manual_seed(0), EngineConfig(max_num_seqs=_DRAWS))
    assert chi_square_p(batch.tokens, joint) > _P_PASS


def test_the_test_rejects_accepting_every_draft(setup):
    """Always accepting samples the draft's distribution; the statistic must catch it."""
    target, draft, params, joint = setup
    batch, _ = generate_speculative(target, draft, [_PROMPT], params, torch.Generator().manual_seed(0), 2,
                                    EngineConfig(max_num_seqs=_DRAWS), _always_accept=True)
    assert chi_square_p(batch.tokens, joint) < _P_FAIL


def test_behaviour_logp_is_the_targets():
    target = make_target(seed=3)
    draft = draft_from_target(target, 1)
    params = SamplingParams(group_size=4, max_new_tokens=7, temperature=0.9, top_k=4, top_p=0.9, stop_ids=(5,))
    batch, _ = generate_speculative(target, draft, [_PROMPT, [2, 3]], params, torch.Generator().manual_seed(1), 3)
    for row in range(8):
        prompt = [_PROMPT, [2, 3]][row // 4]
        gen = batch.tokens[row, : batch.length[row]].tolist()
        assert batch.finish_reason[row] == 0 or len(gen) == 7
        with torch.no_grad():
            logits = target(torch.tensor([prompt + gen]))[0, len(prompt) - 1: -1]
        # The target's truncated distribution (the sampler the plain engine uses) of the same tokens.
        expected = truncated_logprobs(logits, 0.9, 4, 0.9)[torch.arange(len(gen)), gen]
        assert torch.allclose(torch.from_numpy(batch.behav_logp[row, : len(gen)]), expected.float(), atol=1e-4)


def test_a_fixed_seed_reproduces_the_speculative_batch():
    target = make_target(seed=2)
    draft = draft_from_target(target, 2)
    params = SamplingParams(group_size=3, max_new_tokens=9, temperature=1.2, stop_ids=(0,))
    a, _ = generate_speculative(target, draft, [_PROMPT, [3]], params, torch.Generator().manual_seed(4), 2)
    b, _ = generate_speculative(target, draft, [_PROMPT, [3]], params, torch.Generator().manual_seed(4), 2)
    assert np.array_equal(a.tokens, b.tokens) and np.array_equal(a.behav_logp, b.behav_logp)
    # One group at a time: the same tokens (per-sequence uniforms), log-probs equal up to batch-shape rounding.
    c, _ = generate_speculative(target, draft, [_PROMPT, [3]], params, torch.Generator().manual_seed(4), 2,
                                EngineConfig(page_size=2, max_num_seqs=3))
    assert np.array_equal(a.tokens, c.tokens) and np.allclose(a.behav_logp, c.behav_logp, atol=1e-5)
