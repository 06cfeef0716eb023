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

Decode view. The pool is the storage of record: every K/V is written to its block's slot. Decode
attention on a CPU, though, is a batched matrix-vector product whose cost is reading K and V
once, and gathering every row's blocks out of the pool before each step (what a GPU
paged-attention kernel avoids by reading blocks in place) costs more than the layer's matmuls.
So the live sequences also hold a *lane* each in a contiguous view, per layer
``[lanes * kv_heads, capacity, head_dim]`` (lane-major, then head, then logical token): the
new token of a step is written to its pool slot and to the view, and attention is two
``bmm`` over the first ``live * kv_heads`` matrices of the view, with no copy. A lane's blocks
are gathered from the pool once, when its sequence enters the view (after prefill, or when it
moves to another lane); the whole view is re-gathered only when the longest live context crosses a
block boundary beyond the capacity, or leaves a quarter of it unused. Live lanes stay contiguous:
a finished sequence's lane is taken by the sequence of the last lane, which is re-gathered.
The view costs ``2 * layers * lanes * kv_heads * capacity * head_dim`` elements beside the pool
(``peak_view_bytes``); the pool's block accounting is unchanged by it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["PagedKVCache"]

_CHUNK = 16  # tokens per chunk of the decode view


class PagedKVCache:
    """Block pool, block tables, the decode view and the attention over them.

    Before each forward the engine calls :meth:`prepare_prefill` or :meth:`prepare_decode`; the
    model then calls :meth:`attend` once per layer (the ``AttentionCache`` protocol). A decode
    forward feeds every sequence that holds a lane (every live sequence), in any order.
    """

    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, page_size: int,
                 num_blocks: int, num_seqs: int, dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu", num_lanes: int | None = None, max_len: int | None = None):
        self.page_size, self.num_blocks = page_size, num_blocks
        self.num_layers, self.num_kv_heads, self.head_dim = num_layers, num_kv_heads, head_dim
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
        # The decode view: lane j holds sequence _lane_seqs[j]; lanes [0, live) are in use.
        self.num_lanes = num_seqs if num_lanes is None else num_lanes
        max_len = num_blocks * page_size if max_len is None else max_len
        self._lane_seqs: list[int] = []
        self._lane_of: dict[int, int] = {}
        self._stale: set[int] = set()  # sequences whose lane does not hold their tokens yet
        # Reserved for the longest sequence; a chunk's pages are first touched when a token reaches it.
        view = (num_layers, -(-max_len // _CHUNK), self.num_lanes * num_kv_heads, _CHUNK, head_dim)
        self._view_k = torch.empty(view, dtype=dtype, device=device)
        self._view_v = torch.empty(view, dtype=dtype, device=device)
        self._chunks = 0  # chunks in use: lane tokens [0, _chunks * _CHUNK)
        self._chunks_touched = 0  # chunks zeroed so far (uninitialised memory could hold NaN)

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
    def view_bytes(self) -> int:
        """Bytes of the decode view's chunks touched so far (K and V, every layer)."""
        return 2 * self._view_k[:, : self._chunks_touched].numel() * self._view_k.element_size()

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
        """Give the ``seqs`` of one group their prompt blocks and a lane each.

        Returns (prompt token index, destination slot) pairs to write during prefill: a token of
        a shared block once, a token of the partial block once per sample.
        """
        if len(self._lane_seqs) + len(seqs) > self.num_lanes:
            raise RuntimeError(f"{len(self._lane_seqs)} live sequences + {len(seqs)} exceed the view's "
                               f"{self.num_lanes} lanes; the engine admits at most max_num_seqs")
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
            self._lane_of[s] = len(self._lane_seqs)
            self._lane_seqs.append(s)
            self._stale.add(s)
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
        """Release ``seq``'s blocks and lane; the last lane's sequence moves into the freed lane."""
        for block in self.tables[seq]:
            self._release(block)
        self.tables[seq], self.lengths[seq] = [], 0
        lane = self._lane_of.pop(seq)
        last = self._lane_seqs.pop()
        self._stale.discard(seq)
        if last != seq:
            self._lane_seqs[lane], self._lane_of[last] = last, lane
            self._stale.add(last)

    # -- the decode view --------------------------------------------------------------------
    def _use_chunks(self, chunks: int) -> None:
        if chunks > self._view_k.shape[1]:
            raise RuntimeError(f"a sequence reached {chunks * _CHUNK} tokens, beyond the view's "
                               f"{self._view_k.shape[1] * _CHUNK}; the engine sized it too small")
        if chunks > self._chunks_touched:
            self._view_k[:, self._chunks_touched: chunks].zero_()
            self._view_v[:, self._chunks_touched: chunks].zero_()
            self._chunks_touched = chunks
        self._chunks = chunks

    def _gather_stale(self) -> None:
        """Copy the tokens of every stale sequence from the pool into its lane (slots past a
        sequence's length hold finite values that the mask hides)."""
        if not self._stale:
            return
        lanes = sorted(self._lane_of[s] for s in self._stale)
        P, n, nc = self.page_size, len(lanes), self._chunks
        L, kvh, d = self.num_layers, self.num_kv_heads, self.head_dim
        slots = []
        for j in lanes:
            table = self.tables[self._lane_seqs[j]]
            slots += [table[t // P] * P + t % P if t // P < len(table) else 0 for t in range(nc * _CHUNK)]
        slots = torch.tensor(slots)
        # Runs of consecutive lanes: an admission is one run, a moved sequence one lane.
        runs, start = [], 0
        for i in range(1, n + 1):
            if i == n or lanes[i] != lanes[i - 1] + 1:
                runs.append((start, i))
                start = i
        for pool, view in ((self.k, self._view_k), (self.v, self._view_v)):
            rows = pool.view(L, -1, kvh * d).index_select(1, slots)  # (L, n * nc * CHUNK, kvh * d)
            rows = rows.view(L, n, nc, _CHUNK, kvh, d).permute(0, 2, 1, 4, 3, 5)  # (L, nc, n, kvh, CHUNK, d)
            lanes_view = view.view(L, -1, self.num_lanes, kvh, _CHUNK, d)
            for a, b in runs:
                lanes_view[:, :nc, lanes[a]: lanes[a] + b - a].copy_(rows[:, :, a:b])
        self._stale.clear()

    # -- one forward ------------------------------------------------------------------------
    def prepare_prefill(self, src: torch.Tensor, dst: torch.Tensor, valid: torch.Tensor) -> None:
        """Prompts right-padded to [A, L]; ``src`` indexes the flattened [A*L] tokens, ``dst`` their slots."""
        L = valid.shape[1]
        causal = torch.ones(L, L, dtype=torch.bool, device=valid.device).tril()
        # Right padding: a padded query still sees the valid keys before it, so no row is empty.
        mask = causal[None, None] & valid[:, None, None, :]  # (A, 1, L, L)
        self._step = ("prefill", src, dst, mask)

    def prepare_decode(self, seqs: list[int], positions: torch.Tensor) -> None:
        """``positions`` [B, T]: logical indices of the T tokens each sequence feeds (slots reserved).

        ``seqs`` are the sequences holding lanes, in the order of the forward's rows.
        """
        if len(seqs) != len(self._lane_seqs) or set(seqs) != self._lane_of.keys():
            raise RuntimeError(f"a decode step feeds every live sequence: got {len(seqs)} of "
                               f"{len(self._lane_seqs)} live")
        P, kvh, lanes = self.page_size, self.num_kv_heads, self.num_lanes
        B, T = positions.shape
        self._use_chunks(-(-(int(positions.max()) + 1) // _CHUNK))
        self._gather_stale()
        write = torch.tensor([self.tables[s][p // P] * P + p % P
                              for s, row in zip(seqs, positions.tolist()) for p in row])  # (B*T,) pool slots
        lane = torch.tensor([self._lane_of[s] for s in seqs])  # (B,) lane of each row
        heads = torch.arange(kvh)
        # Row (lane, head) of chunk p // CHUNK, token p % CHUNK: (B*kvh*T,) rows of the layer's view.
        chunk_row = (positions[:, None, :] // _CHUNK * lanes + lane[:, None, None]) * kvh + heads[None, :, None]
        view_write = (chunk_row * _CHUNK + positions[:, None, :] % _CHUNK).reshape(-1)
        if torch.equal(lane, torch.arange(B)):
            to_lanes = None
        else:
            to_lanes = torch.empty_like(lane)
            to_lanes[lane] = torch.arange(B)  # row feeding lane j
            positions = positions[to_lanes]
        # Additive mask in lane order: lane j sees view tokens 0 .. positions[j, t] (causal within
        # the new tokens as well).
        hidden = torch.arange(self._chunks * _CHUNK)[None, None, :] > positions[:, :, None]  # (B, T, S)
        bias = torch.zeros(hidden.shape, dtype=self.k.dtype).masked_fill_(hidden, float("-inf"))
        self._step = ("decode", write, view_write, to_lanes, lane, bias)

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
        _, write, view_write, to_lanes, lane, bias = self._step
        B, h, T, d = q.shape
        kvh, nc = k.shape[1], self._chunks
        rep, rows = h // kvh, B * k.shape[1]
        self.k[layer].index_copy_(0, write, k.transpose(1, 2).reshape(B * T, kvh, d))
        self.v[layer].index_copy_(0, write, v.transpose(1, 2).reshape(B * T, kvh, d))
        keys, values = self._view_k[layer], self._view_v[layer]  # (max chunks, lanes*kvh, CHUNK, d)
        keys.view(-1, d).index_copy_(0, view_write, k.reshape(B * kvh * T, d))
        values.view(-1, d).index_copy_(0, view_write, v.reshape(B * kvh * T, d))
        if to_lanes is not None:
            q = q.index_select(0, to_lanes)
        # Grouped-query attention without repeating K/V: the rep query heads sharing a KV head
        # become rep*T query rows of that head's matrix.
        qg = q.reshape(rows, rep * T, d) * d ** -0.5  # rows ordered (rep, T)
        scores = torch.cat([torch.bmm(qg, keys[c, :rows].transpose(1, 2)) for c in range(nc)], dim=-1)
        scores.view(B, kvh, rep, T, -1).add_(bias[:, None, None])  # (B*kvh, rep*T, S)
        probs = torch.softmax(scores, dim=-1)
        out = torch.bmm(probs[..., :_CHUNK], values[0, :rows])
        for c in range(1, nc):
            out.baddbmm_(probs[..., c * _CHUNK: (c + 1) * _CHUNK], values[c, :rows])
        out = out.view(B, h, T, d)
        return out if to_lanes is None else out.index_select(0, lane)
