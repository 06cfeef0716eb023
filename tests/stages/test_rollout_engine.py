"""The torch generation engine and its paged KV cache, checked against full forwards and hand-worked counts."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from stages.policy import DecoderConfig, build_stage
from stages.rollout import FINISH_LENGTH, FINISH_STOP, EngineConfig, RolloutBatch, SamplingParams, generate
from stages.rollout import engine as engine_module
from stages.rollout.paged_kv import PagedKVCache
from stages.rollout.speculative import draft_from_target, generate_speculative

_LOGP_ATOL = 1e-4  # cached decode vs. one full fp32 forward
_VIEW_LOGP_ATOL = 1e-5  # decode views vs. attention over gathered pool blocks: float summation order only
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


def run(model, prompts, params, seed: int = 0, engine: EngineConfig | None = None) -> RolloutBatch:
    return generate(model, prompts, params, torch.Generator().manual_seed(seed), engine)


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


@pytest.mark.parametrize("top_k,top_p", [(0, 0.5), (3, 1.0), (4, 0.6)])
def test_behaviour_logp_is_under_the_truncated_distribution_sampled_from(top_k, top_p):
    """log p(token) under softmax(logits / T) cut to top-k, then to the top-p nucleus, renormalised."""
    model, prompts = make_model(seed=1), make_prompts(seed=1)
    T = 1.3
    params = make_params(temperature=T, top_p=top_p, top_k=top_k)
    batch = run(model, prompts, params)
    G = params.group_size
    for row in range(len(prompts) * G):
        prompt, gen = prompts[row // G], completion(batch, row)
        logits = full_logits(model, prompt + gen)[len(prompt) - 1: -1].double()
        for n, tok in enumerate(gen):
            # Hand-written reference: keep the top-k by sorted order, then the nucleus.
            p = torch.softmax(logits[n] / T, dim=-1)
            order = p.argsort(descending=True).tolist()
            kept = order[: top_k or len(order)]
            mass = p[kept] / p[kept].sum()
            nucleus, total = [], 0.0
            for i, tid in enumerate(kept):
                if total >= top_p:
                    break
                nucleus.append(tid)
                total += float(mass[i])
            assert tok in nucleus, f"sample={row} token={n} sampled outside the kept set"
            expected = float(torch.log(p[tok] / p[nucleus].sum()))
            assert abs(float(batch.behav_logp[row, n]) - expected) <= _LOGP_ATOL, f"sample={row} token={n}"


def test_paged_kv_allocation_counts_shared_prompt_blocks_once_per_group():
    cfg = make_cfg(num_hidden_layers=3, num_key_value_heads=1, head_dim=6, num_attention_heads=2)
    prompts = make_prompts(lengths=(2, 9, 4, 8))
    page, G = 4, 3
    batch = run(make_model(cfg), prompts, make_params(group_size=G, max_new_tokens=7, stop_ids=(5,)),
                engine=EngineConfig(page_size=page, max_num_seqs=64))
    block_bytes = 2 * 3 * 1 * 6 * 4 * page  # K and V x layers x kv heads x head_dim x fp32 x tokens
    blocks = 0
    for g, prompt in enumerate(prompts):  # worked by hand: 9 = 2 shared blocks + a 1-token partial per sample
        full, partial = divmod(len(prompt), page)
        blocks += full + sum(-(-(partial + int(n) - 1) // page) for n in batch.length[g * G:(g + 1) * G])
    assert batch.kv_allocated_bytes == blocks * block_bytes
    assert 0 < batch.kv_cache_bytes <= batch.kv_allocated_bytes <= batch.kv_pool_bytes


def test_results_do_not_depend_on_batching():
    """A sample's tokens depend on (seed, prompt, sample) only: one group at a time gives the same rows."""
    model, prompts = make_model(seed=5), make_prompts(lengths=(3, 6, 1, 5), seed=5)
    params = make_params(group_size=3, max_new_tokens=8, temperature=1.4, stop_ids=(2, 7))
    wide = run(model, prompts, params, seed=11, engine=EngineConfig(page_size=4, max_num_seqs=64))
    narrow = run(model, prompts, params, seed=11, engine=EngineConfig(page_size=3, max_num_seqs=4))
    assert wide.length.min() < params.max_new_tokens, "the seed should stop some samples early"
    assert np.array_equal(wide.tokens, narrow.tokens) and np.array_equal(wide.length, narrow.length)
    assert np.allclose(wide.behav_logp, narrow.behav_logp, atol=1e-5)
    assert narrow.kv_cache_bytes < wide.kv_cache_bytes, "fewer live sequences need fewer blocks at peak"


def test_continuous_batching_refills_finished_slots():
    """With room for one group, the next group starts as soon as the previous one finishes."""
    model, prompts = make_model(seed=6), make_prompts(lengths=(3, 2, 4, 2), seed=6)
    params = make_params(group_size=2, max_new_tokens=6, temperature=1.5, stop_ids=(3, 8))
    batch = run(model, prompts, params, seed=2, engine=EngineConfig(page_size=2, max_num_seqs=2))
    per_group = batch.length.reshape(len(prompts), 2).max(axis=1)
    # A group of max length m takes m - 1 decode steps after its prefill (the first token comes from it).
    assert batch.decode_steps == int((per_group - 1).sum())
    assert batch.decode_steps < len(prompts) * (params.max_new_tokens - 1), "some group should stop early"


def test_sampling_params_and_engine_config_reject_bad_values():
    with pytest.raises(ValueError, match="top_k"):
        make_params(top_k=-1)
    with pytest.raises(ValueError, match="top_p"):
        make_params(top_p=0.0)
    with pytest.raises(ValueError, match="page_size"):
        EngineConfig(page_size=0)
    with pytest.raises(ValueError, match="max_num_seqs"):
        run(make_model(), make_prompts(), make_params(group_size=3), engine=EngineConfig(max_num_seqs=2))


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


def test_pool_holds_groups_left_with_one_live_row():
    """Rows of several groups outlive their siblings: every such group keeps its shared prompt blocks."""
    model, prompts = make_model(seed=7), make_prompts(lengths=(40, 37, 41, 38, 40), seed=7)
    params = make_params(group_size=4, max_new_tokens=12, temperature=1.5, stop_ids=(2, 3, 9))
    batch = run(model, prompts, params, seed=2, engine=EngineConfig(page_size=4, max_num_seqs=5))
    page_bytes = batch.kv_allocated_bytes // sum(  # blocks allocated, by the formula the planner uses
        n // 4 + sum(-(-(n % 4 + int(m) - 1) // 4) for m in batch.length[g * 4:(g + 1) * 4])
        for g, n in enumerate(len(p) for p in prompts))
    one_group = max(n // 4 + 4 * -(-(n % 4 + 12) // 4) for n in map(len, prompts)) * page_bytes  # at full length
    assert batch.kv_cache_bytes > one_group, "the seed should keep two groups' prompt blocks live at once"


class _PoolAttention(PagedKVCache):
    """Reference decode attention: each row's tokens gathered from the pool by its block table
    every step, then masked SDPA over them (the decode views are bypassed)."""

    def prepare_decode(self, seqs, positions):
        super().prepare_decode(seqs, positions)
        self._rows = (list(seqs), positions)

    def _attend_decode(self, layer, q, k, v):
        write, (seqs, positions) = self._step[1], self._rows
        B, h, T, d = q.shape
        kvh, P = k.shape[1], self.page_size
        self.k[layer].index_copy_(0, write, k.transpose(1, 2).reshape(B * T, kvh, d))
        self.v[layer].index_copy_(0, write, v.transpose(1, 2).reshape(B * T, kvh, d))
        out = torch.empty_like(q)
        for b, (seq, pos) in enumerate(zip(seqs, positions)):
            n = int(pos.max()) + 1
            slots = torch.tensor([self.tables[seq][t // P] * P + t % P for t in range(n)])
            keys = self.k[layer, slots].transpose(0, 1).repeat_interleave(h // kvh, 0)  # (h, n, d)
            values = self.v[layer, slots].transpose(0, 1).repeat_interleave(h // kvh, 0)
            mask = torch.arange(n)[None, :] <= pos[:, None]  # (T, n)
            out[b] = F.scaled_dot_product_attention(q[b], keys, values, attn_mask=mask)
        return out


@pytest.mark.parametrize("page, max_num_seqs", [(4, 64), (3, 4), (1, 7)])
def test_decode_views_match_attention_over_the_pool(monkeypatch, page, max_num_seqs):
    """Same tokens, log-probs equal up to summation order, as attention over each row's pool blocks:
    GQA, partial prompt blocks, rows stopping (lanes move) and groups refilled (groups move)."""
    model, prompts = make_model(seed=8), make_prompts(lengths=(3, 9, 1, 6, 13), seed=8)
    params = make_params(group_size=3, max_new_tokens=9, temperature=1.3, stop_ids=(2, 7))
    engine = EngineConfig(page_size=page, max_num_seqs=max_num_seqs)
    views = run(model, prompts, params, seed=4, engine=engine)
    monkeypatch.setattr(engine_module, "PagedKVCache", _PoolAttention)
    pool = run(model, prompts, params, seed=4, engine=engine)
    assert views.length.min() < params.max_new_tokens < views.length.max() + 1, "rows should stop at spread lengths"
    assert np.array_equal(views.tokens, pool.tokens) and np.array_equal(views.length, pool.length)
    assert np.abs(views.behav_logp - pool.behav_logp).max() <= _VIEW_LOGP_ATOL
    assert views.kv_allocated_bytes == pool.kv_allocated_bytes and views.kv_cache_bytes == pool.kv_cache_bytes


def test_speculative_decode_views_match_attention_over_the_pool(monkeypatch):
    """Several new tokens per row and step, rejected drafts truncated: the views still agree."""
    target = make_model(make_cfg(num_hidden_layers=3), seed=9)
    draft = draft_from_target(target, 1)
    prompts = make_prompts(lengths=(5, 2, 8), seed=9)
    params = make_params(group_size=2, max_new_tokens=10, temperature=1.2, stop_ids=(4,))
    engine = EngineConfig(page_size=3, max_num_seqs=4)
    views, stats = generate_speculative(target, draft, prompts, params, torch.Generator().manual_seed(1), 3, engine)
    monkeypatch.setattr(engine_module, "PagedKVCache", _PoolAttention)
    pool, _ = generate_speculative(target, draft, prompts, params, torch.Generator().manual_seed(1), 3, engine)
    assert 0 < stats.accepted < stats.drafted, "some drafts should be rejected"
    assert np.array_equal(views.tokens, pool.tokens) and np.array_equal(views.length, pool.length)
    assert np.abs(views.behav_logp - pool.behav_logp).max() <= _VIEW_LOGP_ATOL


def test_decode_view_bytes_are_counted_by_hand():
    """Shared view: one lane per group of the longest prompt; own view: one 8-token chunk per lane."""
    cfg = make_cfg()  # 2 layers, 2 kv heads, head_dim 8, fp32
    batch = run(make_model(cfg), make_prompts(lengths=(3, 6, 1)), make_params(group_size=3, max_new_tokens=6))
    layers, kvh, d, fp32 = 2, 2, 8, 4
    shared = 3 * kvh * 6 * d  # 3 groups x kv heads x longest prompt x head_dim
    own = 9 * kvh * 8 * d  # 9 lanes x kv heads x one chunk (5 fed tokens) x head_dim
    assert batch.kv_view_bytes == 2 * layers * (shared + own) * fp32
