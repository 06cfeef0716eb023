"""Supervised warm-up that makes the tiny task's base policy.

Teacher-forced next-token training on "<bos>a+b=" + answer + "<eos>", the loss on the answer
tokens only. Short on purpose: GRPO should start well below the task's ceiling. Deterministic for
a given seed and thread count.
"""

from __future__ import annotations

import numpy as np
import torch

from stages.policy import DecoderConfig, build_stage, hf_state
from stages.policy.tokenizer import TextCodec

__all__ = ["supervised_warmup", "greedy_accuracy"]


def _encode_pairs(codec: TextCodec, pairs: list[tuple[str, str]]):
    seqs = [[codec.bos_id] + codec.encode(p) + codec.encode(a) + [codec.eos_id] for p, a in pairs]
    starts = [1 + len(codec.encode(p)) for p, _ in pairs]  # index of the first answer token
    width = max(map(len, seqs))
    ids = torch.full((len(seqs), width), codec.pad_id, dtype=torch.long)
    mask = torch.zeros((len(seqs), width), dtype=torch.float32)
    for i, (s, start) in enumerate(zip(seqs, starts)):
        ids[i, : len(s)] = torch.tensor(s)
        mask[i, start - 1 : len(s) - 1] = 1.0  # positions that predict answer tokens and EOS
    return ids, mask


def supervised_warmup(model_cfg: DecoderConfig, codec: TextCodec, pairs: list[tuple[str, str]],
                      steps: int, batch_size: int, lr: float, seed: int) -> dict[str, torch.Tensor]:
    """HF-named weights of the warmed-up base policy."""
    gen = torch.Generator().manual_seed(seed)
    model = build_stage(model_cfg)
    model.init_weights(gen)
    ids, mask = _encode_pairs(codec, pairs)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    order = np.random.default_rng(seed)
    for _ in range(steps):
        rows = torch.from_numpy(order.integers(0, len(pairs), size=batch_size))
        x, m = ids[rows], mask[rows]
        logp = torch.log_softmax(model(x[:, :-1]), dim=-1)
        nll = -logp.gather(-1, x[:, 1:, None]).squeeze(-1)
        loss = (nll * m[:, :-1]).sum() / m[:, :-1].sum()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    return hf_state(model)


@torch.no_grad()
def greedy_accuracy(model, codec: TextCodec, pairs: list[tuple[str, str]], max_new_tokens: int) -> float:
    """Share of prompts whose greedy completion is exactly the answer."""
    hits = 0
    for prompt, answer in pairs:
        ids = [codec.bos_id] + codec.encode(prompt)
        out = []
        for _ in range(max_new_tokens):
            nxt = int(model(torch.tensor([ids + out]))[0, -1].argmax())
            if nxt == codec.eos_id:
                break
            out.append(nxt)
        hits += codec.decode(out) == answer
    return hits / len(pairs)
