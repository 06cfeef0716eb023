"""Packed rows in the model (block-diagonal causal mask, per-document positions) and chunked
log-probs on the last stage (same loss and gradients, a fraction of the memory)."""

from __future__ import annotations

import pytest
import torch

from conftest import make_decoder_config, make_model
from stages.policy import build_stage, hf_state, load_hf_state
from stages.policy.model import document_mask, document_positions
from stages.train.live_bytes import LiveTensorBytes
from stages.train.loss import (TARGET_FIELDS, LossConfig, chunked_token_logp, grpo_chunked_loss,
                               grpo_microbatch_loss, make_chunked_loss, token_logp)

LOSS = LossConfig(clip_eps_low=0.2, clip_eps_high=0.28, kl_beta=0.1, temperature=0.9)


# -- packed rows in the model ------------------------------------------------------------------
def test_document_positions_restart_per_document():
    doc = torch.tensor([[0, 0, 0, 1, 1, 2, -1, -1], [5, 5, 5, 5, 5, 5, 5, 5]])
    assert document_positions(doc).tolist() == [[0, 1, 2, 0, 1, 0, 0, 1], list(range(8))]
    mask = document_mask(doc)[0, 0]
    assert mask[4].tolist() == [False, False, False, True, True, False, False, False]
    assert mask.diagonal().all()  # padding too sees itself: no empty softmax


@pytest.mark.parametrize("tied", [False, True])
def test_packed_documents_equal_separate_rows(tied):
    cfg = make_decoder_config(tie_word_embeddings=tied)
    model = make_model(cfg).eval()
    gen = torch.Generator().manual_seed(1)
    docs = [torch.randint(3, cfg.vocab_size, (n,), generator=gen) for n in (5, 1, 7, 3)]
    pad = 4
    ids = torch.cat([*docs, torch.zeros(pad, dtype=torch.long)])[None]  # (1, 20)
    doc_ids = torch.cat([torch.full((len(d),), i) for i, d in enumerate(docs)] + [torch.full((pad,), -1)])[None]
    with torch.no_grad():
        packed = model(ids, doc_ids=doc_ids)[0]  # positions derived from doc_ids
        given = model(ids, positions=document_positions(doc_ids), doc_ids=doc_ids)[0]
        alone = torch.cat([model(d[None])[0] for d in docs])
    assert torch.isfinite(packed).all()
    torch.testing.assert_close(packed[: alone.shape[0]], alone, atol=1e-5, rtol=0)
    torch.testing.assert_close(given, packed, atol=0, rtol=0)


def test_packed_rows_through_pipeline_stages_equal_the_whole_model():
    cfg = make_decoder_config()
    whole = make_model(cfg).eval()
    stages = [build_stage(cfg, s, 3) for s in range(3)]
    for s in stages:
        load_hf_state(s, hf_state(whole))
    ids = torch.randint(3, cfg.vocab_size, (2, 12), generator=torch.Generator().manual_seed(2))
    doc_ids = torch.tensor([[0] * 4 + [1] * 6 + [-1] * 2, [3] * 12])
    with torch.no_grad():
        x = ids
        for s in stages:  # every stage receives the same keyword tensors
            x = s(x, doc_ids=doc_ids)
        torch.testing.assert_close(x, whole(ids, doc_ids=doc_ids), atol=1e-6, rtol=0)


def test_doc_ids_with_a_kv_cache_is_refused():
    model = make_model()
    with pytest.raises(ValueError, match="doc_ids"):
        model(torch.ones(1, 3, dtype=torch.long), cache=object(), doc_ids=torch.zeros(1, 3, dtype=torch.long))


# -- chunked log-probs -------------------------------------------------------------------------
def make_target(B: int, T: int, vocab: int, completion_share: float = 0.5, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    target = torch.zeros(B, T, len(TARGET_FIELDS))
    mask = (torch.rand(B, T, generator=gen) < completion_share).float()
    target[..., 0] = torch.randint(0, vocab, (B, T), generator=gen).float()
    target[..., 1] = mask
    target[..., 2] = torch.randn(B, T, generator=gen)
    target[..., 3] = -torch.log(torch.tensor(float(vocab))) + 0.1 * torch.randn(B, T, generator=gen)
    target[..., 4] = target[..., 3] + 0.05 * torch.randn(B, T, generator=gen)
    target[..., 5] = mask / mask.sum().clamp(min=1)
    return target


@pytest.mark.parametrize("chunk_tokens", [1, 5, 64, 10_000])
@pytest.mark.parametrize("share", [0.5, 0.0])
def test_chunked_loss_equals_full_logits_loss(chunk_tokens, share):
    torch.manual_seed(0)
    head = torch.nn.Linear(16, 37, bias=False)
    hidden = torch.randn(3, 11, 16, requires_grad=True)
    target = make_target(3, 11, 37, share)
    full, full_stats = grpo_microbatch_loss(head(hidden), target, LOSS)
    g_full = torch.autograd.grad(full, (hidden, head.weight))
    chunked, stats = grpo_chunked_loss(hidden, target, head, LOSS, chunk_tokens)
    g_chunked = torch.autograd.grad(chunked, (hidden, head.weight))  # empty selection: still connected
    torch.testing.assert_close(chunked, full, atol=1e-6, rtol=1e-6)
    for a, b in zip(g_chunked, g_full):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)
    for field in ("loss", "kl_sum", "clipped_sum", "tokens"):
        assert getattr(stats, field) == pytest.approx(getattr(full_stats, field), abs=1e-5)


def test_make_chunked_loss_and_chunked_token_logp():
    torch.manual_seed(1)
    head = torch.nn.Linear(8, 21, bias=False)
    hidden = torch.randn(2, 9, 8)
    target = make_target(2, 9, 21)
    seen = []
    loss = make_chunked_loss(head, LOSS, 4, on_stats=seen.append)(hidden, target)
    assert len(seen) == 1 and seen[0].loss == pytest.approx(loss.item())
    next_ids = target[..., 0].long()
    torch.testing.assert_close(chunked_token_logp(hidden, next_ids, head, 0.9, 5),
                               token_logp(head(hidden), next_ids, 0.9), atol=1e-6, rtol=0)


def _peak_bytes(fn) -> int:
    with LiveTensorBytes() as mem:
        fn()
    return mem.peak_bytes


def test_chunked_logp_peak_memory_is_a_fraction_of_the_full_logits():
    """Peak bytes of tensors alive at once during loss forward + backward (LiveTensorBytes):
    the full path holds [tokens, V] fp32 logits, their log-softmax and its gradient; the chunked
    path at most a few [chunk, V] blocks."""
    B, T, H, V, chunk = 4, 512, 32, 4096, 64
    head = torch.nn.Linear(H, V, bias=False)
    hidden = torch.randn(B, T, H, requires_grad=True)
    target = make_target(B, T, V, completion_share=1.0)  # every position scored: no help from the mask
    logits_bytes = B * T * V * 4

    def full():
        grpo_microbatch_loss(head(hidden), target, LOSS)[0].backward()

    def chunked():
        grpo_chunked_loss(hidden, target, head, LOSS, chunk)[0].backward()

    full_peak, chunked_peak = _peak_bytes(full), _peak_bytes(chunked)
    block = chunk * V * 4
    assert full_peak >= 2 * logits_bytes  # logits and log-softmax at least
    # Recomputing one chunk in backward holds its logits, scaled logits, log-softmax and their
    # gradients (~6 blocks), plus the head's weight gradient and hidden's gradient.
    assert chunked_peak <= 6 * block + 2 * H * V * 4 + B * T * H * 4, (full_peak, chunked_peak)
    assert chunked_peak * 5 <= full_peak


def test_live_tensor_bytes_by_hand():
    with LiveTensorBytes() as mem:
        a = torch.ones(1000, 1000)  # 4 MB
        b = a * 2  # 8 MB alive
        del a  # 4 MB
        view = b[:10]  # a view adds nothing
        b.exp_()  # in place adds nothing
        assert mem.live_bytes == 4_000_000
        del b
        assert mem.live_bytes == 4_000_000  # the view keeps the storage
        del view
    assert (mem.live_bytes, mem.peak_bytes) == (0, 8_000_000)
