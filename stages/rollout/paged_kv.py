"""A paged KV cache (PagedAttention, Kwon et al. 2023): fixed-size blocks, one block table per sequence.

Storage per layer is a pool of ``num_blocks * page_size`` token slots ``[slots, kv_heads, head_dim]``
for K and one for V; a block is ``page_size`` consecutive slots and spans every layer (block b of
layer l holds the same tokens as block b of layer l'). A sequence's block table lists its blocks in
token order, so logical token t sits at slot ``table[t // page_size] * page_size + t % page_size``.

Sharing: the ``prompt_len // page_size`` full blocks of a prompt are written once and shared by the
G samples of its group (reference count G). The partially filled last prompt block is copied into a
fresh block of every sample when the group forks (copy-on-write done eagerly: each sample writes
into that block at its first decode step, so the copy would happen anyway). A block returns to the
free list when its reference count drops to 0, i.e. when the last sequence holding it finishes.

A sequence holds a slot for every token whose KV is written: its prompt and each sampled token
that is fed back. The final token of a completion is never fed, so a group of samples with n_s
tokens allocates exactly

    prompt_len // page_size  +  sum_s ceil((prompt_len % page_size + n_s - 1) / page_size)

blocks over its lifetime (``planner.rollout.estimate_paged_kv_blocks``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["PagedKVCache"]


class PagedKVCache:
    """Block pool, block tables and the attention over gathered blocks.

    Before each forward the engine calls :meth:`prepare_prefill` or :meth:`prepare_decode`; the
    model then calls :meth:`attend` once per layer (the ``AttentionCache`` protocol).
    """

    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, page_size: int,
                 num_blocks: int, num_seqs: int, dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu"):
        self.page_size, self.num_blocks = page_size, num_blocks
        shape = (num_layers, num_blocks * page_size, num_kv_heads, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self._free = list(range(num_blocks - 1, -1, -1))  # pop() hands out the lowest id first
        self._refs = [0] * num_blocks
        self.tables: list[list[int]] = [[] for _ in range(num_seqs)]
        self.lengths = [0] * num_seqs  # tokens with a reserved slot, per sequence
        self.blocks_allocated = 0  # cumulative over the cache's life
        self.peak_blocks = 0
        self._step: tuple = ()
        # Gather buffers reused by every layer and step: a fresh multi-MB tensor per call would be
        # mmap-ed and page-faulted each time, costing as much as the copy itself.
        self._gather_k = self._gather_v = torch.empty(0, dtype=dtype, device=device)

    # -- accounting -------------------------------------------------------------------------
    @property
    def block_bytes(self) -> int:
        """K and V of one block over every layer."""
        per_slot = self.k[:, 0].numel() * self.k.element_size()
        return 2 * per_slot * self.page_size

    @property
    def pool_bytes(self) -> int:
        return self.block_bytes * self.num_blocks

    @property
    def live_blocks(self) -> int:
        return self.num_blocks - len(self._free)

    def _alloc(self, refs: int = 1) -> int:
        if not self._free:
            raise RuntimeError(f"KV pool of {self.num_blocks} blocks is exhausted; the engine sized it too small")
        block = self._free.pop()
        self._refs[block] = refs
        self.blocks_allocated += 1
        self.peak_blocks = max(self.peak_blocks, self.live_blocks)
        return block

    def _release(self, block: int) -> None:
        self._refs[block] -= 1
        if self._refs[block] == 0:
            self._free.append(block)

    # -- sequences --------------------------------------------------------------------------
    def add_group(self, seqs: list[int], prompt_len: int) -> tuple[list[int], list[int]]:
        """Give the ``seqs`` of one group their prompt blocks.

        Returns (prompt token index, destination slot) pairs to write during prefill: a token of
        a shared block once, a token of the partial block once per sample.
        """
        P = self.page_size
        full, partial = divmod(prompt_len, P)
        shared = [self._alloc(refs=len(seqs)) for _ in range(full)]
        src = list(range(full * P))
        dst = [shared[t // P] * P + t % P for t in src]
        for s in seqs:
            own = [self._alloc()] if partial else []
            self.tables[s] = shared + own
            self.lengths[s] = prompt_len
            for t in range(full * P, prompt_len):
                src.append(t)
                dst.append(own[0] * P + t % P)
        return src, dst

    def append(self, seq: int, num_tokens: int = 1) -> None:
        """Reserve slots for ``num_tokens`` more tokens of ``seq`` (their KV is written by the next forward)."""
        n = self.lengths[seq] + num_tokens
        table = self.tables[seq]
        while len(table) * self.page_size < n:
            table.append(self._alloc())
        self.lengths[seq] = n

    def truncate(self, seq: int, length: int) -> None:
        """Drop reserved slots beyond ``length`` (rejected draft tokens) and the blocks left empty."""
        table = self.tables[seq]
        keep = -(-length // self.page_size)
        while len(table) > keep:
            self._release(table.pop())
        self.lengths[seq] = length

    def free(self, seq: int) -> None:
        for block in self.tables[seq]:
            self._release(block)
        self.tables[seq], self.lengths[seq] = [], 0

    # -- one forward ------------------------------------------------------------------------
    def prepare_prefill(self, src: torch.Tensor, dst: torch.Tensor, valid: torch.Tensor) -> None:
        """Prompts right-padded to [A, L]; ``src`` indexes the flattened [A*L] tokens, ``dst`` their slots."""
        L = valid.shape[1]
        causal = torch.ones(L, L, dtype=torch.bool, device=valid.device).tril()
        # Right padding: a padded query still sees the valid keys before it, so no row is empty.
        mask = causal[None, None] & valid[:, None, None, :]  # (A, 1, L, L)
        self._step = ("prefill", src, dst, mask)

    def prepare_decode(self, seqs: list[int], positions: torch.Tensor) -> None:
        """``positions`` [B, T]: logical indices of the T tokens each sequence feeds (slots reserved)."""
        P = self.page_size
        nb = max(len(self.tables[s]) for s in seqs)
        table = torch.tensor([self.tables[s] + [0] * (nb - len(self.tables[s])) for s in seqs])  # (B, nb)
        write = (table.gather(1, positions // P) * P + positions % P).reshape(-1)  # (B*T,)
        # Gathered row slot j is logical token j: causal within the new tokens too.
        mask = torch.arange(nb * P)[None, None, :] <= positions[:, :, None]  # (B, T, S)
        if self._gather_k.shape[0] < table.numel():
            shape = (table.numel(), self.k[0].view(self.num_blocks, -1).shape[1])
            self._gather_k = torch.empty(shape, dtype=self.k.dtype, device=self.k.device)
            self._gather_v = torch.empty(shape, dtype=self.k.dtype, device=self.k.device)
        self._step = ("decode", table.reshape(-1), write, mask)

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        if self._step[0] == "prefill":
            return self._attend_prefill(layer, q, k, v)
        return self._attend_decode(layer, q, k, v)

    def _attend_prefill(self, layer, q, k, v):
        # q: (A, h, L, d); k, v: (A, kvh, L, d)
        _, src, dst, mask = self._step
        A, kvh, L, d = k.shape
        self.k[layer].index_copy_(0, dst, k.transpose(1, 2).reshape(A * L, kvh, d)[src])
        self.v[layer].index_copy_(0, dst, v.transpose(1, 2).reshape(A * L, kvh, d)[src])
        rep = q.shape[1] // kvh
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)

    def _attend_decode(self, layer, q, k, v):
        # q: (B, h, T, d); k, v: (B, kvh, T, d) for the T newest tokens of every sequence.
        _, blocks, write, mask = self._step
        B, h, T, d = q.shape
        kvh, S = k.shape[1], mask.shape[-1]
        rep = h // kvh
        self.k[layer].index_copy_(0, write, k.transpose(1, 2).reshape(B * T, kvh, d))
        self.v[layer].index_copy_(0, write, v.transpose(1, 2).reshape(B * T, kvh, d))
        # Whole blocks are contiguous in the pool: gathering them is B * nb memcpys, not B * S.
        n = blocks.numel()
        keys = torch.index_select(self.k[layer].view(self.num_blocks, -1), 0, blocks, out=self._gather_k[:n])
        values = torch.index_select(self.v[layer].view(self.num_blocks, -1), 0, blocks, out=self._gather_v[:n])
        keys, values = keys.view(B, S, kvh, d).transpose(1, 2), values.view(B, S, kvh, d).transpose(1, 2)
        # Grouped-query attention without repeating K/V: the rep query heads sharing a KV head
        # become rep*T query rows of that head.
        qg = q.reshape(B, kvh, rep * T, d)  # rows ordered (rep, T)
        m = mask.repeat(1, rep, 1)[:, None]  # (B, 1, rep*T, S)
        out = F.scaled_dot_product_attention(qg, keys, values, attn_mask=m)
        return out.reshape(B, h, T, d)
