"""The frozen reference's microbatches computed inside a training step's P2P waits
(train.reference_fill): the plan, as arithmetic on what the ranks measured, and each rank's part
of it during the step.

With the reference whole on every rank (reference_parallel=data) and its pass fused into the train
task, the ranks run the reference over the step's microbatches before the pipeline step, a share
each, and one SUM hands every log-prob to the ranks computing the loss. A pipeline rank also idles
inside the step, in the waits of its sends and receives (a gloo send completes once its peer has
posted the receive): 1F1B's first stage after its warm-up forwards, while the last stage runs
its first forward and backward, and again in the drain, while the last stage finishes the pass.
gloo cannot say when an op has completed, so what fits there is planned from the previous step of
the same pass shape:

- each rank records, per wait of a pass, the time from the wait's start to the op's completion
  (``available_ns``: any fill computed there included), and how many microbatches of the pass it
  had forwarded by then;
- a wait can fill microbatch j of its own pass if this rank's forward of j, which the loss of j
  waits on, comes later (:func:`first_fillable`), and any microbatch of a later pass of the step
  (a step of length buckets is several passes: the drain of one holds the next one's reference);
- each rank offers, per pass, its best wait: 80% of it (:data:`FILL_SHARE`), half of what it
  filled where a fill ran past the op last time (:func:`offer`), with its own time for one
  microbatch of each pass shape, measured in its pre-step passes;
- every rank derives the same :class:`FillPlan` from the offers (all-gathered with the step's
  input check): each offer takes the latest eligible microbatches that fit, and the rest are
  balanced over the ranks by their size, unless that leaves the pre-step pass as long as before
  (then nothing is filled: :func:`plan_fill`).

A filled microbatch's log-probs are computed by the same whole reference over the same rows as in
the pre-step pass, so they are the same bits; the rank holding its loss has posted its receive at
the start of the step, waits on it before its last stage's forward of that microbatch, and writes
them into the target where the pre-step pass would have put them.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import numpy as np
import torch
import torch.distributed as dist

from stages.layout import ParallelLayout
from stages.layout.mesh import MeshCoord
from stages.train.timeline import FILL_KIND, Action, RankTimeline, P2PWaitHook

__all__ = ["FILL_SHARE", "MAX_FILL_PASSES", "WaitRecord", "FillPlan", "first_fillable", "offer", "encode_offers",
           "decode_offers", "Fill", "plan_fill", "StepFill"]

FILL_SHARE = 0.8
"""The share of a measured wait its fills may take (waits vary from step to step)."""
_RAN_PAST = 0.02
"""A fill whose wait blocked for less than this share of it after the fill most likely ran past
the op (its completion cannot be observed): the next offer there is half of what it filled."""
MAX_FILL_PASSES = 16
"""Passes of one step an offer covers (the all-gathered offer has a fixed size on every rank, so a
mismatch in the step's inputs is reported by the input check, not by a collective of odd sizes)."""


@dataclass(frozen=True)
class WaitRecord:
    """One send or receive wait of a rank in a pass."""

    available_ns: int
    """From the wait's start, before any fill, to the op's completion."""
    blocked_ns: int
    """The part of it blocked in the wait, after the fills."""
    forwarded: int
    """first_fillable at the wait's start."""
    filled: int = 0
    """Microbatches filled in it."""


def first_fillable(forwards: dict[int, int], last_stage: int) -> int:
    """The first local microbatch a wait can fill, from this rank's forwards so far in the pass
    (stage -> count). A rank holding the last stage writes the log-probs it fills itself: the
    microbatch's forward on that stage must come later. Any other rank sends them to the loss's
    rank, whose forward of j comes after this rank's forward of j on each of its stages: one of
    those must come later."""
    if last_stage in forwards:
        return forwards[last_stage]
    return min(forwards.values())


def offer(waits: Sequence[WaitRecord], num_microbatches: int, later_passes: bool) -> tuple[int, int, int]:
    """(wait ordinal, first local microbatch of its own pass, time budget in ns) of the longest
    wait with something to fill: a microbatch of its pass after it, or ``later_passes``; budget 0:
    none."""
    best = (0, 0, 0)
    for i, w in enumerate(waits):
        if w.forwarded >= num_microbatches and not later_passes:
            continue
        if w.filled and w.blocked_ns < _RAN_PAST * w.available_ns:
            budget = (w.available_ns - w.blocked_ns) // 2
        else:
            budget = int(FILL_SHARE * w.available_ns)
        if budget > best[2]:
            best = (i, min(w.forwarded, num_microbatches), budget)
    return best


_OFFER = 4  # ints per pass: wait ordinal, first microbatch, budget ns, this rank's ns per microbatch of the pass


def encode_offers(offers: Sequence[tuple[int, int, int]], microbatch_ns: Sequence[int]) -> np.ndarray:
    """A rank's offers, one per pass, and its time for one microbatch of each pass (0: not
    measured), as a fixed-size int64 vector (passes past MAX_FILL_PASSES offer none)."""
    out = np.zeros((MAX_FILL_PASSES, _OFFER), np.int64)
    for i, (o, ns) in enumerate(zip(offers[:MAX_FILL_PASSES], microbatch_ns)):
        out[i] = (*o, ns)
    return out.reshape(-1)


def decode_offers(vector: np.ndarray, num_passes: int) -> list[tuple[int, int, int, int]]:
    rows = np.asarray(vector, np.int64).reshape(MAX_FILL_PASSES, _OFFER)
    return [tuple(int(x) for x in rows[i]) if i < MAX_FILL_PASSES else (0, 0, 0, 0) for i in range(num_passes)]


@dataclass(frozen=True)
class Fill:
    """Global microbatch ``microbatch`` of pass ``target_pass``, computed by ``rank`` in its wait
    ``ordinal`` of pass ``wait_pass`` (<= target_pass)."""

    target_pass: int
    microbatch: int
    rank: int
    wait_pass: int
    ordinal: int


@dataclass(frozen=True)
class FillPlan:
    """Who computes each reference microbatch of a step (global microbatch k of pass i: the rows
    [k R / M, (k + 1) R / M) of the pass, data-parallel replica k // (M / D))."""

    owner: tuple[tuple[int, ...], ...]
    """Per pass, per microbatch: the rank computing it in the pre-step pass; -1: filled in a wait."""
    fills: tuple[Fill, ...] = ()
    """In the order each rank computes them."""

    @property
    def num_filled(self) -> int:
        return len(self.fills)


def plan_fill(offers: Sequence[Sequence[tuple[int, int, int, int]]], microbatches: Sequence[int],
              costs: Sequence[float], layout: ParallelLayout) -> FillPlan:
    """The plan every rank derives alike. ``offers[rank][pass]``: that rank's offer and its time
    for one microbatch of the pass (:func:`encode_offers`); ``microbatches[pass]``: M, over every
    data-parallel replica; ``costs[pass]``: one microbatch's relative cost (its rows x columns).
    A rank fills only its own data-parallel replica's microbatches: its own pass's latest first,
    then the later passes'. With nothing offered, or where the rest, balanced, would load the
    busiest rank as much as the round-robin order does, nothing is filled and the pre-step pass
    keeps that order: global microbatch k of the call on rank k mod world."""
    world, D, P = layout.world_size, layout.dp, len(microbatches)
    fills: list[Fill] = []
    taken: set[tuple[int, int]] = set()
    for rank in range(world):
        d = layout.coord(rank).dp
        times = [o[3] for o in offers[rank]]
        for i, (ordinal, first, budget, _) in enumerate(offers[rank]):
            candidates = [(i, j) for j in range(microbatches[i] // D - 1, first - 1, -1)]
            candidates += [(t, j) for t in range(i + 1, P) for j in range(microbatches[t] // D - 1, -1, -1)]
            for t, j in candidates:
                k = d * (microbatches[t] // D) + j
                if (t, k) in taken or times[t] <= 0 or times[t] > budget:
                    continue
                taken.add((t, k))
                fills.append(Fill(t, k, rank, i, ordinal))
                budget -= times[t]
    round_robin, load_rr = [[-1] * M for M in microbatches], [0.0] * world
    k = 0
    for i, M in enumerate(microbatches):
        for j in range(M):
            round_robin[i][j] = (k + j) % world
            load_rr[(k + j) % world] += costs[i]
        k += M
    plain = FillPlan(tuple(map(tuple, round_robin)))
    if not taken:
        return plain
    owner, load = [[-1] * M for M in microbatches], [0.0] * world
    for _, i, k in sorted((-costs[i], i, k) for i, M in enumerate(microbatches) for k in range(M)
                          if (i, k) not in taken):  # the largest first, onto the least loaded rank
        rank = min(range(world), key=lambda r: (load[r], r))
        owner[i][k] = rank
        load[rank] += costs[i]
    if max(load) >= max(load_rr):  # the pre-step pass would take as long: fill nothing
        return plain
    return FillPlan(tuple(map(tuple, owner)), tuple(fills))


_TAG = 1 << 20  # the fills' P2P tags, apart from the schedules' (0): tag _TAG + pass * 4096 + microbatch


class StepFill(P2PWaitHook):
    """One rank's part of a :class:`FillPlan` during the training step (the engine's
    ``TrainRank._forward_backward``): the :class:`~stages.train.timeline.P2PWaitHook` of each
    pass's schedule and the last stage's hook before each forward.

    ``compute(pass, k)`` gives microbatch k's log-probs [rows of k, T] under the whole reference.
    ``outs`` (ranks holding the last stage): the pre-step pass's per-pass log-probs [rows, T], with
    zeros where a microbatch is filled; ``masks``: each pass's completion positions [rows, T], the
    positions whose log-probs the target carries. The filled values go into the target (before the
    loss reads them) and into ``outs`` (:meth:`finish`), so both end as the pre-step pass alone
    would have left them."""

    def __init__(self, plan: FillPlan, microbatches: Sequence[int], rank: int, layout: ParallelLayout, group,
                 compute: Callable[[int, int], torch.Tensor], timeline: RankTimeline, stage_ids: Sequence[int],
                 ref_channel: int, outs: Optional[list[torch.Tensor]] = None,
                 masks: Optional[list[torch.Tensor]] = None, dp_group=None):
        self.plan, self.microbatches, self.rank, self.layout = plan, list(microbatches), rank, layout
        self.group, self.dp_group, self.compute, self.timeline = group, dp_group, compute, timeline
        self.stage_ids, self.last_stage = tuple(stage_ids), layout.num_stages - 1
        self.ref_channel, self.outs, self.masks = ref_channel, outs, masks
        self.coord = layout.coord(rank)
        self.holds_last = self.last_stage in self.stage_ids
        self.delta = [torch.zeros_like(o) for o in outs] if outs is not None and plan.num_filled else None
        self.filled, self.fill_ns = 0, 0
        self._pass: Optional[int] = None
        self._mine: dict[tuple[int, int], list[Fill]] = {}  # (wait pass, ordinal) -> this rank's fills there
        for f in plan.fills:
            if f.rank == rank:
                self._mine.setdefault((f.wait_pass, f.ordinal), []).append(f)
        self._recv: dict[tuple[int, int], tuple] = {}  # (pass, local microbatch) -> (work, buffer, k)
        self._sends: list = []

    def _m(self, index: int) -> int:
        return self.microbatches[index] // self.layout.dp

    def _size(self, index: int) -> int:
        return int(self.outs[index].shape[0]) // self.microbatches[index]

    def _tag(self, f: Fill) -> int:
        return _TAG + f.target_pass * 4096 + f.microbatch

    def loss_rank(self, replica: int) -> int:
        """The rank computing the loss of data-parallel replica ``replica``'s microbatches."""
        return self.layout.rank_of(MeshCoord(self.layout.stage_rank(self.last_stage), replica, 0))

    # -- the step and its passes -------------------------------------------------------------------
    def begin_step(self, targets: Sequence[Optional[torch.Tensor]]) -> None:
        """Before the first pass; ``targets``: this rank's rows of each pass's target (the tensors
        the schedules split into the microbatches' targets), on the last stage. Every receive of
        the step is posted here, so a fill sent in an earlier pass never waits for its receiver."""
        self._targets = list(targets)
        if not self.holds_last:
            return
        for f in self.plan.fills:
            m = self._m(f.target_pass)
            if f.microbatch // m == self.coord.dp and f.rank != self.rank:
                out = self.outs[f.target_pass]
                buf = torch.empty((self._size(f.target_pass), out.shape[1]), dtype=out.dtype)
                work = dist.irecv(buf, src=f.rank, group=self.group, tag=self._tag(f))
                self._recv[(f.target_pass, f.microbatch % m)] = (work, buf, f.microbatch)

    def begin_pass(self, index: int) -> None:
        self._pass, self._ordinal, self.records = index, 0, []
        self._start = len(self.timeline.actions)

    def before(self) -> None:
        forwards = {s: 0 for s in self.stage_ids}
        for a in self.timeline.actions[self._start:]:
            if a.kind == "F":
                forwards[a.stage] += 1
        self._forwarded = first_fillable(forwards, self.last_stage)
        self._filled_here = 0
        for f in self._mine.get((self._pass, self._ordinal), ()):
            t0 = time.time_ns()
            out = self.compute(f.target_pass, f.microbatch).contiguous()
            self.timeline.record(Action(FILL_KIND, -1, f.microbatch, t0, time.time_ns()))
            self.fill_ns += time.time_ns() - t0
            self.filled += 1
            self._filled_here += 1
            dst = self.loss_rank(f.microbatch // self._m(f.target_pass))
            if dst == self.rank:
                self._write(f.target_pass, f.microbatch, out)
            else:
                self._sends.append(dist.isend(out, dst=dst, group=self.group, tag=self._tag(f)))

    def after(self, start_ns: int, blocked_from_ns: int, end_ns: int) -> None:
        self.records.append(WaitRecord(end_ns - start_ns, end_ns - blocked_from_ns, self._forwarded,
                                       self._filled_here))
        self._ordinal += 1

    def before_forward(self, stage: int, microbatch: int) -> None:
        """The last stage's hook before its forward of ``microbatch``: the filled log-probs of it,
        received (a bounded wait: the process group's timeout) and written where the loss reads them."""
        if stage != self.last_stage or (self._pass, microbatch) not in self._recv:
            return
        work, buf, k = self._recv.pop((self._pass, microbatch))
        work.wait()
        self._write(self._pass, k, buf)

    def _write(self, index: int, k: int, values: torch.Tensor) -> None:
        size = self._size(index)
        lo = (k % self._m(index)) * size  # in this replica's rows
        rows = slice(k * size, (k + 1) * size)  # in the pass's rows
        mask = self.masks[index][rows]
        channel = self._targets[index][lo:lo + size, :, self.ref_channel]
        channel[mask] = values[mask].to(channel.dtype)
        self.delta[index][rows] = values

    def end_pass(self) -> list[WaitRecord]:
        """After pass's schedule step: its waits, for the next step's offer."""
        self._pass = None
        return self.records

    def end_step(self) -> None:
        for work in self._sends:
            work.wait()
        if self._recv:
            raise RuntimeError(f"reference fill: microbatches {sorted(self._recv)} (pass, microbatch) were "
                               "planned but never reached their loss")

    def finish(self) -> Optional[list[torch.Tensor]]:
        """After the step: the pre-step pass's log-probs completed with every replica's fills
        (one SUM over the data-parallel ranks of the last stage when there are several), on the
        ranks holding the last stage; None elsewhere."""
        if self.outs is None:
            return None
        if self.layout.dp > 1 and self.plan.num_filled:
            flat = torch.cat([d.reshape(-1) for d in self.delta])
            dist.all_reduce(flat, group=self.dp_group)
            self.delta = [p.reshape(d.shape) for p, d in zip(torch.split(flat, [d.numel() for d in self.delta]),
                                                             self.delta)]
        return [o + d for o, d in zip(self.outs, self.delta)]
