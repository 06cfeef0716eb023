"""A KV cache whose prompt prefix is stored once per prompt and shared by its G samples.

Layout per layer: prefix K/V ``[num_prompts, kv_heads, prompt_len, head_dim]`` written by the
prefill, and decode K/V ``[num_prompts * G, kv_heads, max_new_tokens, head_dim]`` written one
token at a time. Attention of a decode query reads its prompt's prefix (broadcast over the
group, never copied) and its own decode keys. The allocation is therefore exactly

    2 * layers * kv_heads * head_dim * dtype_bytes * (num_prompts * prompt_len + num_prompts * G * max_new)

bytes, the formula the planner uses for the KV footprint with a shared prefix.
"""

from __future__ import annotations

import torch

__all__ = ["PrefixSharedKVCache"]


class PrefixSharedKVCache:
    def __init__(self, num_layers: int, num_prompts: int, group_size: int, prompt_len: int,
                 max_new_tokens: int, num_kv_heads: int, head_dim: int, prompt_mask: torch.Tensor,
                 dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu"):
        P, G = num_prompts, group_size
        shape_p = (num_layers, P, num_kv_heads, prompt_len, head_dim)
        shape_d = (num_layers, P * G, num_kv_heads, max_new_tokens, head_dim)
        self.k_prefix = torch.zeros(shape_p, dtype=dtype, device=device)
        self.v_prefix = torch.zeros(shape_p, dtype=dtype, device=device)
        self.k_decode = torch.zeros(shape_d, dtype=dtype, device=device)
        self.v_decode = torch.zeros(shape_d, dtype=dtype, device=device)
        self.prompt_mask = prompt_mask.bool()  # (P, prompt_len): False on left padding
        self.group_size = G
        self.num_decoded = 0  # decode positions already written (same for every sample)
        self.prefilling = True

    @property
    def allocated_bytes(self) -> int:
        return sum(t.numel() * t.element_size()
                   for t in (self.k_prefix, self.v_prefix, self.k_decode, self.v_decode))

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        if self.prefilling:
            return self._prefill(layer, q, k, v)
        return self._decode(layer, q, k, v)

    def _prefill(self, layer, q, k, v):
        # q: (P, h, T, d); k, v: (P, kvh, T, d) for the whole (left-padded) prompt.
        P, h, T, d = q.shape
        self.k_prefix[layer], self.v_prefix[layer] = k, v
        rep = h // k.shape[1]
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        causal = torch.ones(T, T, dtype=torch.bool, device=q.device).tril()
        mask = causal[None, None] & self.prompt_mask[:, None, None, :]  # (P, 1, T, T)
        # A fully padded query row would softmax over nothing; let it see itself instead.
        mask = mask | torch.eye(T, dtype=torch.bool, device=q.device)[None, None]
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)

    def _decode(self, layer, q, k, v):
        # q: (P*G, h, 1, d); k, v: (P*G, kvh, 1, d) for the newest token of every sample.
        n = self.num_decoded
        self.k_decode[layer, :, :, n] = k[:, :, 0]
        self.v_decode[layer, :, :, n] = v[:, :, 0]
        PG, h, _, d = q.shape
        G, kvh = self.group_size, k.shape[1]
        P, rep = PG // G, h // kvh
        qg = q.view(P, G, kvh, rep, d)  # (P, G, kvh, rep, d)
        kp, vp = self.k_prefix[layer], self.v_prefix[layer]  # (P, kvh, Lp, d)
        kd = self.k_decode[layer, :, :, : n + 1].view(P, G, kvh, n + 1, d)
        vd = self.v_decode[layer, :, :, : n + 1].view(P, G, kvh, n + 1, d)
        scale = d ** -0.5
        s_prefix = torch.einsum("pgkrd,pkld->pgkrl", qg, kp) * scale
        s_prefix = s_prefix.masked_fill(~self.prompt_mask[:, None, None, None, :], float("-inf"))
        s_decode = torch.einsum("pgkrd,pgknd->pgkrn", qg, kd) * scale
        probs = torch.softmax(torch.cat([s_prefix, s_decode], dim=-1), dim=-1)
        Lp = kp.shape[2]
        out = (torch.einsum("pgkrl,pkld->pgkrd", probs[..., :Lp], vp)
               + torch.einsum("pgkrn,pgknd->pgkrd", probs[..., Lp:], vd))
        return out.reshape(PG, h, 1, d)

    def advance(self) -> None:
        """Call after each decode forward: every sample has one more cached token."""
        if self.prefilling:
            self.prefilling = False
        else:
            self.num_decoded += 1
