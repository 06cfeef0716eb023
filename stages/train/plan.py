"""Microbatch planning: whole groups into fixed-shape microbatches under a token budget.

Every microbatch of a run has the same shape [rows, seq_len], and every step has the same number
of them, because the pipeline's shapes are fixed after its first step (a changed shape aborts gloo
or hangs the peers). Two layouts fill that shape:

- padding: one sequence per row, seq_len = S = prompt_width + max_new_tokens;
- packing: sequences laid end to end in rows of ``row_tokens`` slots (next-fit, a sequence never
  straddles rows), told apart by ``doc_ids`` and positions restarting per sequence.

With B = max_tokens_per_microbatch token slots, rows = B // seq_len. In the worst case (every
sequence S tokens long) a row holds c = seq_len // S sequences, a microbatch j = rows * c and
k = j // G whole groups of G. The count of microbatches is that of the worst case, so any step fits:

    M = ceil(num_groups / k)                    if k >= 1   (groups always whole)
    M = num_groups * ceil(G / j)                if k == 0   (some groups may need splitting)

rounded up to a multiple of data_parallel_size D (each replica takes M / D whole microbatches).

The planner walks the groups in store order. A group goes whole into the open microbatch if it
fits there, else whole into a fresh one; only a group that fits no empty microbatch is split, at
sequence boundaries. Why M always suffices: next-fit closes a row only when the next sequence
(<= S tokens) does not fit, so a closed row holds >= c sequences and any j sequences fit an empty
microbatch. Hence with k >= 1 every microbatch takes at least k groups; with k == 0 a group opens
at most ceil(G / j) microbatches (each one it opens and closes holds >= j of its sequences).
Microbatches the step does not need stay empty (padding, zero loss weight). Splitting a group is
exact: advantages and every loss denominator are fixed before the pipeline runs (batch.py).

With ``train.length_buckets`` a step is instead a variable number of passes of a few fixed
shapes (stages/train/buckets.py, which places groups with this module's next-fit cursor).

Pure arithmetic over lengths (numpy, no torch), shared with the config's validation.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Optional

import numpy as np

__all__ = ["MicrobatchLayout", "MicrobatchPlan", "microbatch_layout", "plan_microbatches"]


@dataclass(frozen=True)
class MicrobatchLayout:
    """The fixed shape of a run's global batch: num_microbatches x [rows, seq_len] token slots."""

    num_microbatches: int
    rows: int
    seq_len: int
    group_size: int
    num_groups: int
    max_seq_len: int
    """S: the longest sequence a step can hold (prompt width + max_new_tokens)."""
    packing: bool

    @property
    def tokens_per_microbatch(self) -> int:
        return self.rows * self.seq_len

    @property
    def total_rows(self) -> int:
        return self.num_microbatches * self.rows

    @property
    def worst_case_sequences_per_microbatch(self) -> int:
        """j = rows * (seq_len // S): the sequences of length S one microbatch is sure to hold."""
        return self.rows * (self.seq_len // self.max_seq_len)


def microbatch_layout(num_groups: int, group_size: int, prompt_width: int, max_new_tokens: int,
                      max_tokens_per_microbatch: int, packing: bool, pack_row_tokens: Optional[int] = None,
                      data_parallel_size: int = 1) -> MicrobatchLayout:
    """The layout of a run (see the module docstring for the count rule).

    pack_row_tokens: packing only, the width of a packed row; None makes the whole microbatch one
    row (the varlen layout flash-attention kernels take). Raises ValueError naming the setting.
    """
    S = prompt_width + max_new_tokens
    B = max_tokens_per_microbatch
    if num_groups < 1 or group_size < 1 or data_parallel_size < 1:
        raise ValueError(f"a step needs >= 1 group of >= 1 sample on >= 1 replica, got {num_groups} x "
                         f"{group_size} on {data_parallel_size}")
    if B < S:
        raise ValueError(f"train.max_tokens_per_microbatch={B} is below the longest sequence "
                         f"(prompt width {prompt_width} + rollout.max_new_tokens {max_new_tokens} = {S}): "
                         f"raise it to at least {S}")
    if packing:
        seq_len = B if pack_row_tokens is None else pack_row_tokens
        if not S <= seq_len <= B:
            raise ValueError(f"train.pack_row_tokens={pack_row_tokens} must lie in [{S}, {B}] (the longest "
                             f"sequence, train.max_tokens_per_microbatch): change it or leave it unset")
    else:
        seq_len = S
    rows = B // seq_len
    j = rows * (seq_len // S)  # worst-case sequences per microbatch, >= 1
    k = j // group_size  # worst-case whole groups per microbatch
    M = math.ceil(num_groups / k) if k >= 1 else num_groups * math.ceil(group_size / j)
    M = data_parallel_size * math.ceil(M / data_parallel_size)
    return MicrobatchLayout(M, rows, seq_len, group_size, num_groups, S, packing)


@dataclass(frozen=True, eq=False)
class MicrobatchPlan:
    """Where every sample's sequence sits: sample i fills columns [start_i, start_i + seq_len_i) of
    global row ``row_i`` (= microbatch_i * layout.rows + row within the microbatch)."""

    layout: MicrobatchLayout
    microbatch: np.ndarray  # [N] int64
    row: np.ndarray  # [N] int64, global row
    start: np.ndarray  # [N] int64
    seq_len: np.ndarray  # [N] int64
    split_groups: tuple[int, ...] = field(default=())
    """Groups placed across more than one microbatch (only groups that fit no empty microbatch)."""

    @property
    def num_used(self) -> int:
        """Microbatches holding at least one sequence; the others are all padding."""
        return int(self.microbatch.max()) + 1 if len(self.microbatch) else 0

    @property
    def num_slots(self) -> int:
        """Token slots of the whole global batch, padding included: M x rows x T."""
        return self.layout.num_microbatches * self.layout.tokens_per_microbatch


class _Cursor:
    """Next-fit position in the open microbatch (mb == -1: none open yet)."""

    def __init__(self, layout: MicrobatchLayout):
        self.layout = layout
        self.mb, self.row, self.col = -1, layout.rows, 0

    def fit(self, lengths: np.ndarray, fresh: bool = False) -> Optional[list[tuple[int, int]]]:
        """(row, col) of each sequence placed next-fit from here (or from an empty microbatch), or
        None if they do not all fit in this microbatch. Does not move the cursor."""
        L = self.layout
        row, col = (0, 0) if fresh else (self.row, self.col)
        if self.mb < 0 and not fresh:
            return None
        out = []
        for n in lengths:
            if col > 0 and (not L.packing or col + n > L.seq_len):
                row, col = row + 1, 0  # padding: one sequence per row; packing: next-fit
            if row >= L.rows:
                return None
            out.append((row, col))
            col += int(n)
        return out

    def commit(self, spots: list[tuple[int, int]], lengths: np.ndarray, fresh: bool) -> list[tuple[int, int, int]]:
        """Take the spots ``fit`` returned (opening a microbatch if fresh): (microbatch, row, col)."""
        if fresh:
            self.mb += 1
        (self.row, self.col) = spots[-1]
        self.col += int(lengths[-1])
        return [(self.mb, r, c) for r, c in spots]


def plan_microbatches(seq_len: np.ndarray, layout: MicrobatchLayout) -> MicrobatchPlan:
    """Place sequences (seq_len: [N] tokens each, N = num_groups * G, groups contiguous) into the
    layout's microbatches, keeping groups whole whenever they fit (module docstring)."""
    seq_len = np.asarray(seq_len, dtype=np.int64)
    G, N = layout.group_size, layout.num_groups * layout.group_size
    if seq_len.shape != (N,):
        raise ValueError(f"the step holds {seq_len.shape[0]} samples; the layout was made for "
                         f"{layout.num_groups} groups x {layout.group_size} = {N}")
    if len(seq_len) and (seq_len.min() < 1 or seq_len.max() > layout.max_seq_len):
        raise ValueError(f"sequence lengths must lie in [1, {layout.max_seq_len}] (prompt width + "
                         f"max_new_tokens), got [{seq_len.min()}, {seq_len.max()}]")
    cursor = _Cursor(layout)
    placed: list[tuple[int, int, int]] = []
    split: list[int] = []
    for g in range(layout.num_groups):
        lengths = seq_len[g * G:(g + 1) * G]
        spots = cursor.fit(lengths)
        if spots is not None:
            placed += cursor.commit(spots, lengths, fresh=False)
            continue
        spots = cursor.fit(lengths, fresh=True)
        if spots is not None:
            placed += cursor.commit(spots, lengths, fresh=True)
            continue
        split.append(g)  # fits no empty microbatch: sequence by sequence, next-fit
        for n in lengths[:, None]:
            spot = cursor.fit(n)
            fresh = spot is None
            placed += cursor.commit(spot or cursor.fit(n, fresh=True), n, fresh=fresh)
    mb, row, start = np.array(placed, dtype=np.int64).reshape(-1, 3).T
    assert cursor.mb < layout.num_microbatches, (cursor.mb, layout)  # the count rule's guarantee
    return MicrobatchPlan(layout, mb, mb * layout.rows + row, start, seq_len, tuple(split))
