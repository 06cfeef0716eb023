"""Length buckets: a variable number of fixed-shape pipeline passes per optimiser step.

A pipeline's shapes are fixed after its first step, so the single-layout plan (plan.py) shapes
every row for the worst case, S = prompt width + max_new_tokens. With buckets, a run has a small
fixed set of row widths T_1 < ... < T_k = S (``train.length_buckets``, S always among them), and,
packed, widths above S too: rows that hold two or more sequences of up to S each (a sequence never
straddles rows). Bucket b has its own fixed microbatch shape [rows_b, T_b], rows_b = B // T_b (B
the token budget), and its own pipeline schedule, built once; the schedules share the modules. A
step runs a VARIABLE number of passes, each one ``schedule.step`` of one bucket over D x m
microbatches (m per data-parallel rank), and the gradients of all its passes accumulate before
the one optimiser step. That is exact because every loss weight already carries its global-batch
denominator (batch.py).

Placement, a deterministic function of the stored lengths (so every rank plans the same passes):

1. A group's home bucket is the narrowest with T_b >= its longest sequence (groups stay whole).
   Then groups move up where that saves slots (a bucket holding a fraction of a pass costs a whole
   pass; a wider row costs only its extra padding): first all groups below some bucket c into c
   (the best c), then one bucket's groups one bucket up at a time while that still saves slots.
2. Buckets are filled widest first. Within a bucket, its groups go into microbatches as in plan.py
   (whole if they fit an empty microbatch, else split at sequence boundaries; packed sequences go
   first-fit into the open microbatch's rows), and the microbatches are cut into passes (below).
   Groups are taken in store order, and again longest first; and both again with groups free to
   split: the bucket's sequences go one by one, longest first, into the first row with room among
   all rows opened so far (first-fit decreasing), narrower groups into the free room the same way.
   The plan with the fewest slots is kept, whole groups on a tie. Splitting is exact for the same
   reason as the passes: the loss weights' denominators are the global batch's, fixed before the
   pipeline runs.
3. The bucket's last microbatches are usually part-empty: before moving on, whole groups of
   narrower buckets (widest first, in the same group order) move into their free room.

Microbatches per pass. A pass costs a pipeline fill and drain ((p - 1) microbatch times per
rank for 1F1B), whatever its m, so a bucket's microbatches go into as few passes as
``max_microbatches_per_pass`` allows (unset: one pass per bucket), split evenly, each pass's m
the smallest count >= what it holds that the schedule accepts (layout.schedule_error: 1F1B
m >= p, interleaved m a multiple of its rounds, DualPipeV m >= 2p); never below the run's
minimum ``microbatches_per_pass`` (m < p would leave pipeline ranks idle for the whole pass). The
count therefore varies from step to step: each (bucket, m) gets its own schedule, built at its
first use and cached, so no schedule sees a new shape. Setting the cap to the minimum gives
passes of a fixed count (more fill and drain, fewer empty microbatches).

The metric ``train_token_slots_per_real_token`` is slots run through the pipeline (every pass, every
microbatch, padding and empty microbatches included, over all data-parallel ranks) divided by real
tokens (prompt + completion tokens of every sample): 1.0 means no padding at all.

Pure arithmetic over lengths (numpy, no torch).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Sequence

import numpy as np

from stages.layout import schedule_error
from stages.train.plan import MicrobatchLayout, _Cursor

__all__ = ["BucketedLayout", "BucketedPlan", "bucketed_layout", "plan_passes", "microbatches_per_pass",
           "power_of_two_widths", "valid_microbatches"]


@dataclass(frozen=True)
class BucketedLayout:
    """The fixed shapes of a run's passes: one microbatch layout per bucket (ascending width)."""

    buckets: tuple[MicrobatchLayout, ...]
    """Bucket b: microbatches of [rows_b, T_b]; its num_microbatches is one pass, D x m."""
    microbatches_per_pass: int
    """The smallest m (microbatches per data-parallel rank) of a pass: the schedule's minimum."""
    data_parallel_size: int
    max_microbatches_per_pass: Optional[int] = None
    """m of a pass is at most this (a valid count >= microbatches_per_pass); None: no cap."""
    schedule: tuple[str, int, int] = ("1f1b", 1, 1)
    """(schedule, pipeline ranks, stages per rank): which counts m a pass may take."""

    @property
    def widths(self) -> tuple[int, ...]:
        return tuple(b.seq_len for b in self.buckets)

    @property
    def num_microbatches(self) -> int:
        """Microbatches of the smallest pass over all data-parallel ranks, D x m."""
        return self.data_parallel_size * self.microbatches_per_pass

    def pass_sizes(self, used: int) -> tuple[int, ...]:
        """Global microbatches (D x m) of each pass that holds ``used`` microbatches of one bucket
        (module docstring): as few passes as the cap allows, split evenly, each a valid count."""
        D, cap = self.data_parallel_size, self.max_microbatches_per_pass
        need = max(1, math.ceil(used / D))  # per data-parallel rank
        n = 1 if cap is None else math.ceil(need / cap)
        sizes: list[int] = []
        for i in range(n):  # the larger shares first
            left = need - sum(sizes)
            sizes.append(valid_microbatches(math.ceil(left / (n - i)), self.microbatches_per_pass, *self.schedule))
        return tuple(D * m for m in sizes)

    @property
    def group_size(self) -> int:
        return self.buckets[-1].group_size

    @property
    def num_groups(self) -> int:
        return self.buckets[-1].num_groups

    @property
    def max_seq_len(self) -> int:
        return self.buckets[-1].max_seq_len

    @property
    def packing(self) -> bool:
        return self.buckets[-1].packing


def power_of_two_widths(max_seq_len: int, smallest: int = 8) -> tuple[int, ...]:
    """8, 16, 32, ... below ``max_seq_len``, then ``max_seq_len``: a default bucket set."""
    out, w = [], smallest
    while w < max_seq_len:
        out.append(w)
        w *= 2
    return (*out, max_seq_len)


def microbatches_per_pass(schedule: str, pp: int, virtual: int) -> int:
    """The smallest m >= pp that ``schedule`` runs on pp ranks x ``virtual`` stages (module docstring)."""
    return valid_microbatches(pp, pp, schedule, pp, virtual)


def valid_microbatches(need: int, least: int, schedule: str, pp: int, virtual: int) -> int:
    """The smallest m >= max(need, least) that ``schedule`` runs on pp ranks x ``virtual`` stages."""
    m = start = max(need, least)
    while schedule_error(schedule, pp, m, virtual) is not None:
        m += 1
        if m > start + 64 * pp:  # schedule_error rejects the schedule itself, whatever m
            raise ValueError(schedule_error(schedule, pp, start, virtual))
    return m


def bucketed_layout(num_groups: int, group_size: int, prompt_width: int, max_new_tokens: int,
                    max_tokens_per_microbatch: int, widths: Sequence[int], packing: bool,
                    microbatches: int, data_parallel_size: int = 1, max_microbatches: Optional[int] = -1,
                    schedule: tuple[str, int, int] = ("1f1b", 1, 1)) -> BucketedLayout:
    """Buckets of the given row widths (those below S kept, S added; packed, also those above S up
    to B, each holding sequences of up to S) under a budget of B slots per microbatch, at least
    ``microbatches`` (m) per data-parallel rank and pass and at most ``max_microbatches`` (-1:
    exactly m in every pass; None: no cap), valid counts of ``schedule`` (name, pipeline ranks,
    stages per rank). Raises ValueError naming the key."""
    S = prompt_width + max_new_tokens
    B = max_tokens_per_microbatch
    if B < S:
        raise ValueError(f"train.max_tokens_per_microbatch={B} is below the longest sequence "
                         f"(prompt width {prompt_width} + rollout.max_new_tokens {max_new_tokens} = {S}): "
                         f"raise it to at least {S}")
    if any(w < 2 for w in widths):
        raise ValueError(f"train.length_buckets={list(widths)} must hold row widths >= 2 tokens (a prompt "
                         "token and a completion token)")
    if num_groups < 1 or group_size < 1 or microbatches < 1 or data_parallel_size < 1:
        raise ValueError(f"a step needs >= 1 group of >= 1 sample, >= 1 microbatch per pass on >= 1 replica, got "
                         f"{num_groups} x {group_size}, m={microbatches}, D={data_parallel_size}")
    if max_microbatches == -1:
        max_microbatches = microbatches
    elif max_microbatches is not None and (max_microbatches < microbatches or
                                           schedule_error(schedule[0], schedule[1], max_microbatches, schedule[2])):
        raise ValueError(f"train.max_microbatches_per_pass={max_microbatches} must be a microbatch count that "
                         f"train.schedule={schedule[0]} runs, >= {microbatches} (or unset)")
    kept = sorted({int(w) for w in widths if w < S or (packing and S < w <= B)} | {S})
    per_pass = data_parallel_size * microbatches
    buckets = tuple(MicrobatchLayout(per_pass, B // w, w, group_size, num_groups, min(w, S), packing) for w in kept)
    return BucketedLayout(buckets, microbatches, data_parallel_size, max_microbatches, tuple(schedule))


@dataclass(frozen=True, eq=False)
class BucketedPlan:
    """Where every sample sits: pass ``sample_pass[i]`` (of bucket ``pass_bucket[p]``), global row
    ``row[i]`` of that pass (= microbatch within the pass x rows_b + row), columns from ``start[i]``."""

    layout: BucketedLayout
    pass_bucket: tuple[int, ...]  # [P] bucket of each pass, in run order
    pass_microbatches: tuple[int, ...]  # [P] global microbatches (D x m) of each pass
    sample_pass: np.ndarray  # [N] int64
    row: np.ndarray  # [N] int64
    start: np.ndarray  # [N] int64
    seq_len: np.ndarray  # [N] int64
    split_groups: tuple[int, ...] = ()

    @property
    def num_passes(self) -> int:
        return len(self.pass_bucket)

    @property
    def num_slots(self) -> int:
        """Token slots run through the pipeline over all passes (padding and empty microbatches too)."""
        return sum(n * self.layout.buckets[b].tokens_per_microbatch
                   for b, n in zip(self.pass_bucket, self.pass_microbatches))

    @property
    def slots_per_real_token(self) -> float:
        """train_token_slots_per_real_token: slots / (prompt + completion tokens of every sample)."""
        return self.num_slots / max(int(self.seq_len.sum()), 1)


class _FirstFit(_Cursor):
    """Packed rows: a sequence goes into the first row of the open microbatch with room for it
    (first-fit), not only the last one (next-fit); padded rows are the same either way."""

    def __init__(self, layout: MicrobatchLayout):
        super().__init__(layout)
        self.fill: list[int] = []  # tokens used in each row of the open microbatch

    def fit(self, lengths: np.ndarray, fresh: bool = False) -> Optional[list[tuple[int, int]]]:
        L = self.layout
        if not L.packing:
            return super().fit(lengths, fresh)
        if self.mb < 0 and not fresh:
            return None
        fill = [0] * L.rows if fresh else list(self.fill)
        out = []
        for n in lengths:
            r = next((r for r, used in enumerate(fill) if used + int(n) <= L.seq_len), None)
            if r is None:
                return None
            out.append((r, fill[r]))
            fill[r] += int(n)
        return out

    def commit(self, spots: list[tuple[int, int]], lengths: np.ndarray, fresh: bool) -> list[tuple[int, int, int]]:
        if fresh:
            self.fill = [0] * self.layout.rows
        for (r, _), n in zip(spots, lengths):
            self.fill[r] += int(n)
        return super().commit(spots, lengths, fresh)


class _Rows:
    """Sequences placed one at a time, longest first, into the first row with room among all the
    rows opened so far (first-fit decreasing), else a new row; a microbatch is every ``rows``
    consecutive rows. Padded rows hold one sequence each. Groups end up split wherever that packs."""

    def __init__(self, layout: MicrobatchLayout):
        self.layout = layout
        self.fill = np.zeros(0, np.int64)  # tokens used in each row

    @property
    def microbatches(self) -> int:
        return math.ceil(len(self.fill) / self.layout.rows)

    def place(self, lengths: np.ndarray, max_rows: Optional[int] = None) -> Optional[list[tuple[int, int, int]]]:
        """(microbatch, row, col) of each sequence, in the order given; None (nothing placed) if
        they need more than ``max_rows`` rows."""
        L, fill = self.layout, self.fill.copy()
        out: list[tuple[int, int, int]] = [(0, 0, 0)] * len(lengths)
        for k in np.argsort(-np.asarray(lengths), kind="stable"):
            n = int(lengths[k])
            room = np.flatnonzero(fill + n <= L.seq_len) if L.packing else ()
            if len(room):
                r = int(room[0])
            elif max_rows is not None and len(fill) >= max_rows:
                return None
            else:
                r, fill = len(fill), np.append(fill, 0)
            out[k] = (r // L.rows, r % L.rows, int(fill[r]))
            fill[r] += n
        self.fill = fill
        return out


def _place_group(cursor: _Cursor, lengths: np.ndarray, limit: Optional[int]) -> Optional[list[tuple[int, int, int]]]:
    """Place a whole group next-fit (open microbatch, else a fresh one below ``limit`` microbatches);
    None if it fits neither."""
    spots = cursor.fit(lengths)
    if spots is not None:
        return cursor.commit(spots, lengths, fresh=False)
    if limit is not None and cursor.mb + 1 >= limit:
        return None
    spots = cursor.fit(lengths, fresh=True)
    return None if spots is None else cursor.commit(spots, lengths, fresh=True)


def plan_passes(seq_len: np.ndarray, layout: BucketedLayout) -> BucketedPlan:
    """Place sequences (seq_len: [N] tokens each, groups of G contiguous) into bucketed passes."""
    seq_len = np.asarray(seq_len, dtype=np.int64)
    G, N = layout.group_size, layout.num_groups * layout.group_size
    if seq_len.shape != (N,):
        raise ValueError(f"the step holds {seq_len.shape[0]} samples; the layout was made for "
                         f"{layout.num_groups} groups x {G} = {N}")
    if N and (seq_len.min() < 1 or seq_len.max() > layout.max_seq_len):
        raise ValueError(f"sequence lengths must lie in [1, {layout.max_seq_len}] (prompt width + "
                         f"max_new_tokens), got [{seq_len.min()}, {seq_len.max()}]")
    groups = seq_len.reshape(-1, G)
    home = np.searchsorted(np.asarray(layout.widths), groups.max(axis=1))  # narrowest T_b >= longest
    store_order = np.arange(layout.num_groups)
    longest_first = np.argsort(-groups.sum(axis=1), kind="stable")
    plans = [_search(seq_len, layout, home, order, split)
             for split in (False, True) for order in (store_order, longest_first)]
    return min(plans, key=lambda p: p.num_slots)  # a tie keeps whole groups, then store order


def _search(seq_len: np.ndarray, layout: BucketedLayout, home: np.ndarray, order: np.ndarray,
            split: bool) -> BucketedPlan:
    """Candidates: groups below bucket c all moved up to c (c = 0: every group at home); the best,
    then single buckets moved up one while that saves slots. Ties keep the narrower placement."""
    best = None
    for c in range(len(layout.buckets)):
        trial = np.maximum(home, c)
        plan = _plan_homes(seq_len, layout, trial, order, split)
        if best is None or plan.num_slots < best.num_slots:
            best, chosen = plan, trial
    home = chosen
    improved = True
    while improved:  # move a whole bucket's groups one bucket up while that saves slots
        improved = False
        for b in range(len(layout.buckets) - 1):
            if not (home == b).any():
                continue
            trial = np.where(home == b, b + 1, home)
            plan = _plan_homes(seq_len, layout, trial, order, split)
            if plan.num_slots < best.num_slots:
                home, best, improved = trial, plan, True
    return best


def _plan_homes(seq_len: np.ndarray, layout: BucketedLayout, home: np.ndarray, order: np.ndarray,
                split: bool) -> BucketedPlan:
    """The passes when group g starts in bucket home[g], groups taken in ``order`` (steps 2 and 3
    of the module docstring); ``split``: the bucket's sequences go into rows one by one, first-fit
    decreasing (:class:`_Rows`), and narrower groups into the free room the same way."""
    G, N = layout.group_size, layout.num_groups * layout.group_size
    groups = seq_len.reshape(layout.num_groups, G)
    pending = [[int(g) for g in order if home[g] == b] for b in range(len(layout.buckets))]
    sample_pass, row, start = (np.zeros(N, np.int64) for _ in range(3))
    pass_bucket: list[int] = []
    pass_microbatches: list[int] = []
    split_groups: list[int] = []
    for b in reversed(range(len(layout.buckets))):
        if not pending[b]:
            continue
        bucket = layout.buckets[b]
        placed: list[tuple[int, list[tuple[int, int, int]]]] = []  # (group, [(mb, row, col)])
        if split:
            rows = _Rows(bucket)
            spots = rows.place(groups[pending[b]].reshape(-1))
            placed += [(g, spots[i * G:(i + 1) * G]) for i, g in enumerate(pending[b])]
            sizes = layout.pass_sizes(rows.microbatches)
            place = lambda lengths: rows.place(lengths, sum(sizes) * bucket.rows)  # noqa: E731
        else:
            cursor = _FirstFit(bucket)
            for g in pending[b]:
                spots = _place_group(cursor, groups[g], None)
                if spots is None:  # fits no empty microbatch: sequence by sequence, next-fit
                    spots = []
                    for n in groups[g][:, None]:
                        spot = cursor.fit(n)
                        fresh = spot is None
                        spots += cursor.commit(spot or cursor.fit(n, fresh=True), n, fresh=fresh)
                placed.append((g, spots))
            sizes = layout.pass_sizes(cursor.mb + 1)
            place = lambda lengths: _place_group(cursor, lengths, sum(sizes))  # noqa: E731
        for c in reversed(range(b)):  # fill the passes' free room with narrower groups
            for g in list(pending[c]):
                spots = place(groups[g])
                if spots is not None:
                    placed.append((g, spots))
                    pending[c].remove(g)
        split_groups += [g for g, spots in placed if len({mb for mb, _, _ in spots}) > 1]
        first = len(pass_bucket)
        pass_bucket += [b] * len(sizes)
        pass_microbatches += sizes
        ends = np.cumsum(sizes)
        for g, spots in placed:
            for k, (mb, r, col) in enumerate(spots):
                i = g * G + k
                j = int(np.searchsorted(ends, mb, side="right"))
                sample_pass[i] = first + j
                row[i] = (mb - (ends[j] - sizes[j])) * bucket.rows + r
                start[i] = col
    return BucketedPlan(layout, tuple(pass_bucket), tuple(pass_microbatches), sample_pass, row, start, seq_len,
                        tuple(split_groups))
