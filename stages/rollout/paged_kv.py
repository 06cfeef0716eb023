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

Decode views. The pool is the storage of record: every K/V is written to its block's slot. Decode
attention on a CPU, though, is a batched matrix-vector product whose cost is reading K and V, and
gathering every row's blocks out of the pool before each step (what a GPU paged-attention kernel
avoids by reading blocks in place) costs more than the layer's matmuls. So decode attention reads
two contiguous views, filled from the pool once and then written in place beside it:

- the *shared view* ``[group lanes * kv_heads, longest prompt, head_dim]`` per layer holds each
  live group's prompt once (its shared blocks and its partial block, whose G copies are equal);
  the group's live rows query it together, one ``bmm`` per (group, kv head) with G query rows, so
  a prompt is read once per group and step (the shared-prefix split of Hydragen, Juravsky et al.
  2024);
- the *own view*, chunks of ``_CHUNK`` tokens ``[lanes * kv_heads, _CHUNK, head_dim]`` per layer,
  holds each live sequence's fed tokens in a lane; a step's new token goes to its pool slot and
  its lane, and attention is one ``bmm`` per chunk over the first ``live * kv_heads`` matrices,
  with no copy. Chunks are added and dropped as the longest own context grows and shrinks, so the
  view never moves.

One softmax runs over the concatenated scores of both parts (the same attention as over the
gathered blocks, up to float summation order). A lane (a group lane) is gathered from the pool
when its sequence (group) enters the view after prefill, or moves: live lanes stay contiguous, a
finished sequence's lane is taken by the last lane's sequence, which is re-gathered.
The views cost bytes beside the pool (``view_bytes``: the shared view plus the own chunks touched);
the pool's block accounting is unchanged by them.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["PagedKVCache"]

_CHUNK = 8  # tokens per chunk of the own view


class PagedKVCache:
    """Block pool, block tables, the decode views and the attention over them.

    Before each forward the engine calls :meth:`prepare_prefill` or :meth:`prepare_decode`; the
    model then calls :meth:`attend` once per layer (the ``AttentionCache`` protocol). A decode
    forward feeds every live sequence (every sequence given blocks and not yet freed), in any order.
    """

    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, page_size: int,
                 num_blocks: int, num_seqs: int, dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu", *, group_size: int = 1, num_lanes: int | None = None,
                 max_own_tokens: int | None = None):
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
        # Lanes of the own view: lane j holds sequence _lanes.seqs[j]; group lanes of the shared
        # view: group lane g holds group _groups.seqs[g] (a group is named by its first sequence).
        self.group_size = group_size
        self.num_lanes = num_seqs if num_lanes is None else num_lanes
        self._lanes = _Lanes()
        self._groups = _Lanes()
        self._group_of: dict[int, tuple[int, int]] = {}  # live sequence -> (group, sample index)
        self._members: dict[int, list[int]] = {}  # group -> its live sequences
        self._prompt_len: dict[int, int] = {}  # group -> its prompt's length
        max_own = num_blocks * page_size if max_own_tokens is None else max_own_tokens
        own = (num_layers, -(-max_own // _CHUNK), self.num_lanes * num_kv_heads, _CHUNK, head_dim)
        # Reserved for the longest sequence; a chunk's pages are first touched when a token reaches it.
        self._own_k = torch.empty(own, dtype=dtype, device=device)
        self._own_v = torch.empty(own, dtype=dtype, device=device)
        self._chunks = 0  # own chunks in use: own tokens [0, _chunks * _CHUNK)
        self._chunks_touched = 0  # own chunks zeroed so far (uninitialised memory could hold NaN)
        self._num_group_lanes = min(self.num_lanes, -(-num_seqs // group_size))
        self._shared_k = self._shared_v = torch.empty((num_layers, 0, 0, head_dim), dtype=dtype, device=device)

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
        """Bytes of the decode views beside the pool: the shared view and the own chunks touched."""
        own = self._own_k[:, : self._chunks_touched].numel()
        return 2 * (own + self._shared_k.numel()) * self._own_k.element_size()

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
        if len(seqs) > self.group_size:
            raise ValueError(f"a group of {len(seqs)} sequences exceeds the cache's group_size={self.group_size}")
        if len(self._lanes.seqs) + len(seqs) > self.num_lanes:
            raise RuntimeError(f"{len(self._lanes.seqs)} live sequences + {len(seqs)} exceed the view's "
                               f"{self.num_lanes} lanes; the engine admits at most max_num_seqs")
        P = self.page_size
        full, partial = divmod(prompt_len, P)
        shared = [self._alloc(refs=len(seqs)) for _ in range(full)]
        src = list(range(full * P))
        dst = [shared[t // P] * P + t % P for t in src]
        for i, s in enumerate(seqs):
            own = [self._alloc()] if partial else []
            self.tables[s] = shared + own
            self.lengths[s] = prompt_len
            for t in range(full * P, prompt_len):
                src.append(t)
                dst.append(own[0] * P + t % P)
            self._lanes.add(s)
            self._group_of[s] = (seqs[0], i)
        self._groups.add(seqs[0])
        self._members[seqs[0]], self._prompt_len[seqs[0]] = list(seqs), prompt_len
        if prompt_len > self._shared_k.shape[2]:  # a longer prompt: re-gather every live group
            shape = (self.num_layers, self._num_group_lanes * self.num_kv_heads, prompt_len, self.head_dim)
            self._shared_k = torch.empty(shape, dtype=self.k.dtype, device=self.k.device)
            self._shared_v = torch.empty(shape, dtype=self.k.dtype, device=self.k.device)
            self._groups.stale.update(self._groups.seqs)
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
        """Release ``seq``'s blocks, its lane, and its group's lane once the group has no live sequence."""
        for block in self.tables[seq]:
            self._release(block)
        self.tables[seq], self.lengths[seq] = [], 0
        self._lanes.remove(seq)
        group, _ = self._group_of.pop(seq)
        self._members[group].remove(seq)
        if not self._members[group]:
            self._groups.remove(group)
            del self._members[group], self._prompt_len[group]

    # -- the decode views -------------------------------------------------------------------
    def _shared_len(self, seq: int) -> int:
        return self._prompt_len[self._group_of[seq][0]]

    def _use_chunks(self, chunks: int) -> None:
        if chunks > self._own_k.shape[1]:
            raise RuntimeError(f"a sequence holds {chunks * _CHUNK} own tokens, beyond the view's "
                               f"{self._own_k.shape[1] * _CHUNK}; the engine sized it too small")
        if chunks > self._chunks_touched:
            self._own_k[:, self._chunks_touched: chunks].zero_()
            self._own_v[:, self._chunks_touched: chunks].zero_()
            self._chunks_touched = chunks
        self._chunks = chunks

    def _gather(self, lanes: _Lanes, slots_of, view_k: torch.Tensor, view_v: torch.Tensor, chunk: int) -> None:
        """Copy the tokens of every stale entry of ``lanes`` (``slots_of(key)``: its pool slots,
        chunk by chunk) into its lane of the views ``[L, chunks, lanes * kv_heads, chunk, d]``."""
        if not lanes.stale or chunk == 0:
            lanes.stale.clear()
            return
        idx = sorted(lanes.index[key] for key in lanes.stale)
        slots = torch.tensor([slot for j in idx for slot in slots_of(lanes.seqs[j])], dtype=torch.long
                             ).to(self.k.device)
        L, kvh, d, n = self.num_layers, self.num_kv_heads, self.head_dim, len(idx)
        runs, start = [], 0  # runs of consecutive lanes: an admission is one run, a moved lane one
        for i in range(1, n + 1):
            if i == n or idx[i] != idx[i - 1] + 1:
                runs.append((start, i))
                start = i
        for pool, view in ((self.k, view_k), (self.v, view_v)):
            rows = pool.view(L, -1, kvh * d).index_select(1, slots).view(L, n, -1, chunk, kvh, d)
            rows = rows.permute(0, 2, 1, 4, 3, 5)  # (L, chunks, n, kvh, chunk, d)
            lane_view = view.view(L, view.shape[1], -1, kvh, chunk, d)
            for a, b in runs:
                lane_view[:, :, idx[a]: idx[a] + b - a].copy_(rows[:, :, a:b])
        lanes.stale.clear()

    def _shared_slots(self, group: int) -> list[int]:
        """Pool slots of ``group``'s prompt, padded with slot 0 to the shared view's length. The
        partial block's tokens are read from a live sample's copy (all copies are equal)."""
        return self._slots(self._members[group][0], 0, self._shared_k.shape[2])

    def _slots(self, seq: int, start: int, tokens: int) -> list[int]:
        """Pool slots of tokens [start, start + tokens) of ``seq``; slot 0 past its blocks."""
        P, table = self.page_size, self.tables[seq]
        return [table[t // P] * P + t % P if t // P < len(table) else 0 for t in range(start, start + tokens)]

    # -- one forward ------------------------------------------------------------------------
    def prepare_prefill(self, src: torch.Tensor, dst: torch.Tensor, valid: torch.Tensor) -> None:
        """Prompts right-padded to [A, L]; ``src`` indexes the flattened [A*L] tokens, ``dst`` their slots."""
        dev = self.k.device
        src, dst, valid = src.to(dev), dst.to(dev), valid.to(dev)
        L = valid.shape[1]
        causal = torch.ones(L, L, dtype=torch.bool, device=valid.device).tril()
        # Right padding: a padded query still sees the valid keys before it, so no row is empty.
        mask = causal[None, None] & valid[:, None, None, :]  # (A, 1, L, L)
        self._step = ("prefill", src, dst, mask)

    def prepare_decode(self, seqs: list[int], positions: torch.Tensor) -> None:
        """``positions`` [B, T] on the host: logical indices of the T tokens each of ``seqs`` (every
        live sequence, in the order of the forward's rows) feeds; their slots are reserved."""
        if len(seqs) != len(self._lanes.seqs) or set(seqs) != self._lanes.index.keys():
            raise RuntimeError(f"a decode step feeds every live sequence: got {len(seqs)} of "
                               f"{len(self._lanes.seqs)} live")
        P, kvh, G = self.page_size, self.num_kv_heads, self.group_size
        B, T = positions.shape
        shared = torch.tensor([self._shared_len(s) for s in seqs])  # (B,)
        own = positions - shared[:, None]  # (B, T) own token index
        self._use_chunks(-(-(int(own.max()) + 1) // _CHUNK))
        nc, S = self._chunks, self._shared_k.shape[2]
        self._gather(self._lanes, lambda s: self._slots(s, self._shared_len(s), nc * _CHUNK),
                     self._own_k[:, :nc], self._own_v[:, :nc], _CHUNK)
        self._gather(self._groups, self._shared_slots, self._shared_k[:, None], self._shared_v[:, None], S)
        write = torch.tensor([self.tables[s][p // P] * P + p % P
                              for s, row in zip(seqs, positions.tolist()) for p in row])  # (B*T,) pool slots
        lane = torch.tensor([self._lanes.index[s] for s in seqs])  # (B,) lane of each row
        # Row (chunk own // CHUNK, lane, head) of the own view, token own % CHUNK: (B*kvh*T,)
        chunk_row = (own[:, None, :] // _CHUNK * self.num_lanes + lane[:, None, None]) * kvh \
            + torch.arange(kvh)[None, :, None]
        own_write = (chunk_row * _CHUNK + own[:, None, :] % _CHUNK).reshape(-1)
        to_lanes = None
        if not torch.equal(lane, torch.arange(B)):
            to_lanes = torch.empty_like(lane)
            to_lanes[lane] = torch.arange(B)  # the row feeding lane j
            own, shared, seqs = own[to_lanes], shared[to_lanes], [seqs[i] for i in to_lanes.tolist()]
        # Additive mask in lane order over [shared tokens, own tokens]: lane j sees its group's
        # shared tokens and its own tokens up to own[j, t] (causal within the new tokens as well).
        hidden = torch.cat([(torch.arange(S)[None, :] >= shared[:, None])[:, None, :].expand(B, T, S),
                            torch.arange(nc * _CHUNK)[None, None, :] > own[:, :, None]], dim=-1)
        bias = torch.zeros(hidden.shape, dtype=self.k.dtype).masked_fill_(hidden, float("-inf"))  # (B, T, S+own)
        # Slot of lane j among its group's G query rows: group lane * G + sample index.
        query_slot = torch.tensor([self._groups.index[self._group_of[s][0]] * G + self._group_of[s][1] for s in seqs])
        # Built on the host from the block tables; one copy each to the pool's device (none on the CPU).
        dev = self.k.device
        self._step = ("decode", write.to(dev), own_write.to(dev), None if to_lanes is None else to_lanes.to(dev),
                      lane.to(dev), bias.to(dev), query_slot.to(dev))

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
        _, write, own_write, to_lanes, lane, bias, query_slot = self._step
        B, h, T, d = q.shape
        kvh, nc, S, G = k.shape[1], self._chunks, self._shared_k.shape[2], self.group_size
        R, rows = h // kvh * T, B * kvh  # query rows per kv head: (rep, T); matrices of the batch
        self.k[layer].index_copy_(0, write, k.transpose(1, 2).reshape(B * T, kvh, d))
        self.v[layer].index_copy_(0, write, v.transpose(1, 2).reshape(B * T, kvh, d))
        keys, values = self._own_k[layer], self._own_v[layer]  # (chunks, lanes*kvh, CHUNK, d)
        keys.view(-1, d).index_copy_(0, own_write, k.reshape(B * kvh * T, d))
        values.view(-1, d).index_copy_(0, own_write, v.reshape(B * kvh * T, d))
        if to_lanes is not None:
            q = q.index_select(0, to_lanes)
        # Grouped-query attention without repeating K/V: the rep query heads sharing a KV head
        # become rep*T query rows of that head's matrix.
        q = q * d ** -0.5
        parts = [torch.bmm(q.reshape(rows, R, d), keys[c, :rows].transpose(1, 2)) for c in range(nc)]
        if S:
            # Shared prompts: each group's G query slots (zero for finished samples) against its matrix.
            groups = len(self._groups.seqs)
            slots = q.new_zeros(groups * G, h, T, d).index_copy_(0, query_slot, q)
            slots = slots.view(groups, G, kvh, R, d).transpose(1, 2).reshape(groups * kvh, G * R, d)
            s = torch.bmm(slots, self._shared_k[layer, : groups * kvh].transpose(1, 2))  # (groups*kvh, G*R, S)
            s = s.view(groups, kvh, G, R, S).transpose(1, 2).reshape(groups * G, kvh, R, S)
            parts.insert(0, s.index_select(0, query_slot).view(rows, R, S))
        scores = torch.cat(parts, dim=-1)  # (B*kvh, R, S + chunks*CHUNK)
        scores.view(B, kvh, -1, T, scores.shape[-1]).add_(bias[:, None, None])
        probs = torch.softmax(scores, dim=-1)
        out = torch.bmm(probs[..., S: S + _CHUNK], values[0, :rows])
        for c in range(1, nc):
            out.baddbmm_(probs[..., S + c * _CHUNK: S + (c + 1) * _CHUNK], values[c, :rows])
        if S:
            p = probs.new_zeros(groups * G, kvh, R, S).index_copy_(0, query_slot, probs[..., :S].view(B, kvh, R, S))
            p = p.view(groups, G, kvh, R, S).transpose(1, 2).reshape(groups * kvh, G * R, S)
            o = torch.bmm(p, self._shared_v[layer, : groups * kvh])  # (groups*kvh, G*R, d)
            o = o.view(groups, kvh, G, R, d).transpose(1, 2).reshape(groups * G, kvh, R, d)
            out += o.index_select(0, query_slot).view(rows, R, d)
        out = out.view(B, h, T, d)
        return out if to_lanes is None else out.index_select(0, lane)


class _Lanes:
    """Keys held in contiguous lanes [0, len(seqs)); a removed key's lane goes to the last key."""

    def __init__(self) -> None:
        self.seqs: list[int] = []
        self.index: dict[int, int] = {}
        self.stale: set[int] = set()  # keys whose lane does not hold their tokens yet

    def add(self, key: int) -> None:
        self.index[key] = len(self.seqs)
        self.seqs.append(key)
        self.stale.add(key)

    def remove(self, key: int) -> None:
        lane, last = self.index.pop(key), self.seqs.pop()
        self.stale.discard(key)
        if last != key:
            self.seqs[lane], self.index[last] = last, lane
            self.stale.add(last)
