"""The frozen reference's microbatches computed inside a training step's receive waits
(train.reference_fill): the plan, as arithmetic on what the ranks measured.

With the reference whole on every rank (reference_parallel=data) and its pass fused into the train
task, the ranks run the reference over the step's microbatches before the pipeline step, a share
each, and one SUM hands every log-prob to the ranks computing the loss. A pipeline rank also idles
inside the step: a receive it waits on (for 1F1B's first stage, the gradient of the first
microbatch, while the last stage runs its forward and backward). gloo cannot say when a receive
has completed, so what fits there is planned from the previous step of the same pass shape:

- each rank records, per receive wait of a pass, the time from the wait's start to the receive's
  completion (``available_ns``: any fill computed there included), and how many microbatches it
  had forwarded by then (a microbatch j can be filled there only if this rank's forward of j, which
  the loss of j waits on, comes later: :func:`first_fillable`);
- it offers its best wait: as many whole-reference microbatches as fit in ``FILL_SHARE`` of it at
  the time one took in its own pre-step pass (:func:`offer`), one fewer where a fill ran past the
  receive last time;
- every rank derives the same :class:`FillPlan` from the offers (they are all-gathered with the
  step's input check): the offered microbatches, latest first, leave the pre-step pass, and the
  rest are balanced over the ranks by their size, unless that leaves the pre-step pass as long
  as before (then nothing is filled: :func:`plan_fill`).

A filled microbatch's log-probs are computed by the same whole reference over the same rows as in
the pre-step pass, so they are the same bits; the rank holding its loss receives them before its
last stage's forward of that microbatch and writes them into the target, where the pre-step pass
would have put them.
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
from stages.train.timeline import FILL_KIND, Action, RankTimeline, RecvWaitHook

__all__ = ["FILL_SHARE", "MAX_FILL_PASSES", "WaitRecord", "FillPlan", "first_fillable", "offer", "encode_offers",
           "decode_offers", "plan_fill", "StepFill"]

FILL_SHARE = 0.8
"""The share of a measured wait its fills may take (waits vary from step to step)."""
_RAN_PAST = 0.02
"""A fill whose wait blocked for less than this share of it after the fill most likely ran past
the receive (its completion cannot be observed): the next offer there is one microbatch fewer."""
MAX_FILL_PASSES = 16
"""Passes of one step an offer covers (the all-gathered offer has a fixed size on every rank, so a
mismatch in the step's inputs is reported by the input check, not by a collective of odd sizes)."""


@dataclass(frozen=True)
class WaitRecord:
    """One receive wait of a rank in a pass."""

    available_ns: int
    """From the wait's start, before any fill, to the receive's completion."""
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


def offer(waits: Sequence[WaitRecord], microbatch_ns: float, num_microbatches: int) -> tuple[int, int, int]:
    """(wait ordinal, first local microbatch, count) of the wait taking the most microbatches of
    ``microbatch_ns`` each; count 0: none."""
    best = (0, 0, 0)
    for i, w in enumerate(waits):
        room = num_microbatches - w.forwarded
        if room <= 0 or microbatch_ns <= 0:
            continue
        if w.filled and w.blocked_ns < _RAN_PAST * w.available_ns:
            count = w.filled - 1
        else:
            count = int(FILL_SHARE * w.available_ns // microbatch_ns)
        count = min(count, room)
        if count > best[2]:
            best = (i, w.forwarded, count)
    return best


def encode_offers(offers: Sequence[tuple[int, int, int]]) -> np.ndarray:
    """A rank's offers, one per pass, as a fixed-size int64 vector (passes past MAX_FILL_PASSES offer none)."""
    out = np.zeros((MAX_FILL_PASSES, 3), np.int64)
    for i, o in enumerate(offers[:MAX_FILL_PASSES]):
        out[i] = o
    return out.reshape(-1)


def decode_offers(vector: np.ndarray, num_passes: int) -> list[tuple[int, int, int]]:
    rows = np.asarray(vector, np.int64).reshape(MAX_FILL_PASSES, 3)
    return [tuple(int(x) for x in rows[i]) if i < MAX_FILL_PASSES else (0, 0, 0) for i in range(num_passes)]


@dataclass(frozen=True)
class FillPlan:
    """Who computes each reference microbatch of a step (global microbatch k of pass i: the rows
    [k R / M, (k + 1) R / M) of the pass, data-parallel replica k // (M / D))."""

    owner: tuple[tuple[int, ...], ...]
    """Per pass, per microbatch: the rank computing it in the pre-step pass; -1: filled in a wait."""
    fills: tuple[tuple[tuple[int, int, int], ...], ...]
    """Per pass: (microbatch, filling rank, wait ordinal), in the order each rank computes them."""

    @property
    def num_filled(self) -> int:
        return sum(len(f) for f in self.fills)


def plan_fill(offers: Sequence[Sequence[tuple[int, int, int]]], microbatches: Sequence[int],
              costs: Sequence[float], layout: ParallelLayout) -> FillPlan:
    """The plan every rank derives alike. ``offers[rank][pass]``: that rank's offer
    (:func:`offer`); ``microbatches[pass]``: M, over every data-parallel replica; ``costs[pass]``:
    one microbatch's relative cost (its rows x columns). With no microbatch offered, or where the
    rest, balanced, would load the busiest rank as much as the round-robin order does, nothing is
    filled and the pre-step pass keeps that order: global microbatch k of the call on rank k mod
    world."""
    world, D = layout.world_size, layout.dp
    fills: list[list[tuple[int, int, int]]] = [[] for _ in microbatches]
    taken: set[tuple[int, int]] = set()
    for rank in range(world):
        d = layout.coord(rank).dp
        for i, (ordinal, first, count) in enumerate(offers[rank]):
            m = microbatches[i] // D
            for j in range(m - 1, max(first, 0) - 1, -1):
                if count <= 0:
                    break
                k = d * m + j
                if (i, k) not in taken:
                    taken.add((i, k))
                    fills[i].append((k, rank, ordinal))
                    count -= 1
    round_robin, load_rr = [[-1] * M for M in microbatches], [0.0] * world
    k = 0
    for i, M in enumerate(microbatches):
        for j in range(M):
            round_robin[i][j] = (k + j) % world
            load_rr[(k + j) % world] += costs[i]
        k += M
    plain = FillPlan(tuple(map(tuple, round_robin)), tuple(() for _ in microbatches))
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
    return FillPlan(tuple(map(tuple, owner)), tuple(tuple(sorted(f, key=lambda x: (x[1], x[2], -x[0])))
                                                    for f in fills))


_TAG = 1 << 20  # the fills' P2P tags, apart from the schedules' (0): tag _TAG + pass * 4096 + microbatch


class StepFill(RecvWaitHook):
    """One rank's part of a :class:`FillPlan` during the training step (the engine's
    ``TrainRank._forward_backward``): the :class:`~stages.train.timeline.RecvWaitHook` of each
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
        self.delta = [torch.zeros_like(o) for o in outs] if outs is not None else None
        self.filled, self.fill_ns = 0, 0
        self._pass: Optional[int] = None

    def loss_rank(self, replica: int) -> int:
        """The rank computing the loss of data-parallel replica ``replica``'s microbatches."""
        return self.layout.rank_of(MeshCoord(self.layout.stage_rank(self.last_stage), replica, 0))

    # -- a pass ------------------------------------------------------------------------------------
    def begin_pass(self, index: int, target: Optional[torch.Tensor]) -> None:
        """Before pass ``index``'s schedule step; ``target``: this rank's rows of its target
        (the tensor the schedule splits into the microbatches' targets), on the last stage."""
        self._pass, self._target, self._ordinal, self.records = index, target, 0, []
        self._start = len(self.timeline.actions)
        M = self.microbatches[index]
        self._m = M // self.layout.dp
        self._size = int(self.outs[index].shape[0]) // M if self.outs is not None else 0
        self._mine: dict[int, list[int]] = {}
        self._recv: dict[int, tuple] = {}  # local microbatch -> (work, buffer, k)
        self._sends: list = []
        for k, filler, ordinal in self.plan.fills[index]:
            if filler == self.rank:
                self._mine.setdefault(ordinal, []).append(k)
            if self.holds_last and k // self._m == self.coord.dp and filler != self.rank:
                buf = torch.empty((self._size, self.outs[index].shape[1]), dtype=self.outs[index].dtype)
                work = dist.irecv(buf, src=filler, group=self.group, tag=_TAG + index * 4096 + k)
                self._recv[k % self._m] = (work, buf, k)

    def before(self) -> None:
        forwards = {s: 0 for s in self.stage_ids}
        for a in self.timeline.actions[self._start:]:
            if a.kind == "F":
                forwards[a.stage] += 1
        self._forwarded = first_fillable(forwards, self.last_stage)
        self._filled_here = 0
        for k in self._mine.get(self._ordinal, ()):
            t0 = time.time_ns()
            out = self.compute(self._pass, k).contiguous()
            self.timeline.record(Action(FILL_KIND, -1, k, t0, time.time_ns()))
            self.fill_ns += time.time_ns() - t0
            self.filled += 1
            self._filled_here += 1
            target = self.loss_rank(k // self._m)
            if target == self.rank:
                self._write(k, out)
            else:
                self._sends.append(dist.isend(out, dst=target, group=self.group, tag=_TAG + self._pass * 4096 + k))

    def after(self, start_ns: int, blocked_from_ns: int, end_ns: int) -> None:
        self.records.append(WaitRecord(end_ns - start_ns, end_ns - blocked_from_ns, self._forwarded,
                                       self._filled_here))
        self._ordinal += 1

    def before_forward(self, stage: int, microbatch: int) -> None:
        """The last stage's hook before its forward of ``microbatch``: the filled log-probs of it,
        received (a bounded wait: the process group's timeout) and written where the loss reads them."""
        if stage != self.last_stage or microbatch not in self._recv:
            return
        work, buf, k = self._recv.pop(microbatch)
        work.wait()
        self._write(k, buf)

    def _write(self, k: int, values: torch.Tensor) -> None:
        i, size = self._pass, self._size
        lo = (k % self._m) * size  # in this replica's rows
        rows = slice(k * size, (k + 1) * size)  # in the pass's rows
        mask = self.masks[i][rows]
        channel = self._target[lo:lo + size, :, self.ref_channel]
        channel[mask] = values[mask].to(channel.dtype)
        self.delta[i][rows] = values

    def end_pass(self) -> list[WaitRecord]:
        for work in self._sends:
            work.wait()
        if self._recv:
            raise RuntimeError(f"reference fill: microbatches {sorted(self._recv)} of pass {self._pass} were "
                               "received but never reached their loss")
        self._pass = None
        return self.records

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
