"""Pipeline schedules as per-rank action orders, plus their closed-form bubbles.

An action is ``F`` (forward), ``B`` (full backward), ``I`` (backward for inputs) or ``W`` (backward for
weights) of one virtual stage on one microbatch. The orders follow the schedules of
``torch.distributed.pipelining`` (the runtime's engine) so a simulated order is the order the runtime
executes:

- ``gpipe``: all forwards, then all backwards (Huang et al. 2019).
- ``1f1b``: PipeDream-Flush warm-up / steady / cool-down (Narayanan et al. 2021, Sec. 2.2).
- ``interleaved-1f1b``: v virtual stages per rank, depth-first (Narayanan et al. 2021, Sec. 2.2.2).
- ``zb-h1``: 1F1B with B split into I and W; rank r defers its first r W's (Qi et al. 2023, "Zero Bubble
  Pipeline Parallelism", ZB-H1; torch ``ScheduleInterleavedZeroBubble`` with one stage per rank).
- ``zbv``: two stages per rank in a V (stage r and 2p-1-r), I/W split (Qi et al. 2023, Sec. 6, ZB-V).
- ``dualpipev``: DeepSeek-V3's DualPipe cut in half (V placement). Approximate: the overlapped F&B pairs
  are executed one after the other, as torch's runtime does; DualPipe's compute/all-to-all overlap of two
  microbatches is not modelled.

Ranks are pipeline ranks (the PP axis); stage indices are virtual stages ``0 .. p*v-1``.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from functools import lru_cache
from typing import NamedTuple

from stages.layout import SCHEDULES, ScheduleName, schedule_error, stage_to_rank

__all__ = [
    "ScheduleName",
    "SCHEDULES",
    "Action",
    "PipelineOrder",
    "build_pipeline_order",
    "bubble_fraction_gpipe",
    "bubble_fraction_1f1b",
    "bubble_fraction_interleaved",
    "idle_time_zb_h1",
    "estimate_closed_form_bubble",
]

# Names, torch's constraints (schedule_error) and stage placement (stage_to_rank) are shared with the
# runtime in stages/layout/pipeline.py; this module adds the action orders and the closed forms.


class Action(NamedTuple):
    """One compute action: ``kind`` in F/B/I/W, virtual ``stage``, ``microbatch`` index."""

    kind: str
    stage: int
    microbatch: int


@dataclass(frozen=True, slots=True)
class PipelineOrder:
    """The actions each pipeline rank executes, in order."""

    schedule: str
    num_ranks: int
    num_virtual: int
    num_microbatches: int
    stage_ranks: tuple[int, ...]
    """rank holding each virtual stage"""
    rank_actions: tuple[tuple[Action, ...], ...]
    loss_group_microbatches: int = 1
    """microbatches whose forwards must all finish on the last stage before any of their backwards"""

    @property
    def num_stages_total(self) -> int:
        return self.num_ranks * self.num_virtual


@lru_cache(maxsize=1024)  # orders are immutable and the search asks for the same ones many times
def build_pipeline_order(schedule: str, num_ranks: int, num_microbatches: int, num_virtual: int = 1,
                         *, loss_group_microbatches: int = 1) -> PipelineOrder:
    """Per-rank action order of ``schedule`` for p ranks, m microbatches, v virtual stages per rank.

    ``loss_group_microbatches`` = k > 1 models a loss that needs k microbatches' forwards (e.g. a group
    statistic computed inside the pipeline): only ``gpipe``/``1f1b`` support it, and 1F1B then needs k-1
    extra warm-up forwards on every rank.
    """
    error = schedule_error(schedule, num_ranks, num_microbatches, num_virtual)
    if error:
        raise ValueError(error)
    if loss_group_microbatches > 1 and schedule not in ("gpipe", "1f1b"):
        raise ValueError(f"loss_group_microbatches > 1 is modelled for gpipe and 1f1b only, not {schedule}")
    p, m, v = num_ranks, num_microbatches, num_virtual
    if schedule == "gpipe":
        orders = [_gpipe_rank(r, m) for r in range(p)]
    elif schedule == "1f1b":
        orders = [_one_f_one_b_rank(r, p, m, loss_group_microbatches - 1) for r in range(p)]
    elif schedule == "interleaved-1f1b":
        orders = [_looped_rank(r, p, m, v, zero_bubble=False) for r in range(p)]
    elif schedule == "zb-h1":
        orders = [_looped_rank(r, p, m, 1, zero_bubble=True) for r in range(p)]
    elif schedule == "zbv":
        orders = [_zbv_rank(r, p, m) for r in range(p)]
    else:
        orders = [_dualpipev_rank(r, p, m) for r in range(p)]
    return PipelineOrder(schedule, p, v, m, stage_to_rank(schedule, p, v), tuple(tuple(o) for o in orders),
                         loss_group_microbatches)


def _gpipe_rank(rank: int, m: int) -> list[Action]:
    return [Action("F", rank, j) for j in range(m)] + [Action("B", rank, j) for j in range(m)]


def _one_f_one_b_rank(rank: int, p: int, m: int, extra_warmup: int) -> list[Action]:
    warmup = min(p - rank - 1 + extra_warmup, m)
    ops = [Action("F", rank, j) for j in range(warmup)]
    for i in range(m - warmup):
        ops += [Action("F", rank, warmup + i), Action("B", rank, i)]
    return ops + [Action("B", rank, j) for j in range(m - warmup, m)]


def _looped_rank(rank: int, p: int, m: int, v: int, *, zero_bubble: bool) -> list[Action]:
    """Interleaved 1F1B (zero_bubble=False) or ZB-H1 / interleaved ZB (zero_bubble=True), depth first."""
    rounds = max(1, m // p)
    per_round = m // rounds
    warmup = min((v - 1) * per_round + (1 if zero_bubble else 2) * (p - 1 - rank), m * v)
    steady = m * v - warmup

    def fwd_stage(step: int) -> int:
        return ((step // per_round) % v) * p + rank

    def bwd_stage(step: int) -> int:
        return (v - 1 - ((step - warmup) // per_round) % v) * p + rank

    counters: dict[tuple[str, int], int] = defaultdict(int)
    ops: list[Action] = []

    def emit(kind: str, stage: int) -> None:
        ops.append(Action(kind, stage, counters[kind, stage]))
        counters[kind, stage] += 1

    backward_steps: list[int] = []
    weights_done = 0
    for step in range(warmup + steady + warmup):
        if step < warmup + steady:
            emit("F", fwd_stage(step))
        if step >= warmup:
            emit("I" if zero_bubble else "B", bwd_stage(step))
            backward_steps.append(step)
            # rank r runs its first r backwards without W, so W fills the cool-down bubble (ZB-H1)
            if zero_bubble and step - warmup >= rank:
                emit("W", bwd_stage(backward_steps[weights_done]))
                weights_done += 1
    while zero_bubble and weights_done < len(backward_steps):
        emit("W", bwd_stage(backward_steps[weights_done]))
        weights_done += 1
    return ops


def _zbv_rank(rank: int, p: int, m: int) -> list[Action]:
    """ZB-V order (Qi et al. 2023 Sec. 6) as generated by torch ``ScheduleZBVZeroBubble``."""
    n = max(2 * p - 1, m)  # pad to fill the V, then drop padded microbatches
    first, second = rank, 2 * p - 1 - rank
    count: dict[tuple[str, int], int] = defaultdict(int)
    ops: list[Action] = []

    def emit(kind: str, stage: int, counter_kind: str | None = None) -> None:
        key = (counter_kind or kind, stage)
        ops.append(Action(kind, stage, count[key]))
        count[key] += 1

    for _ in range(2 * (p - rank) - 1):
        emit("F", first)
    for _ in range(rank):
        emit("F", second)
        emit("F", first)
    for _ in range(p - rank):
        emit("F", second)
        emit("I", second)
        emit("W", second)
    while count["F", second] < count["F", first] or count["F", first] < n:
        if count["F", first] < n:
            emit("F", first)
        emit("I", first)
        emit("W", first)
        emit("F", second)
        emit("I", second)
        emit("W", second)
    for _ in range(rank):
        emit("I", first)
        emit("I", second)
    for _ in range(p - rank):
        emit("I", first)
        emit("W", first)
    while count["W", second] < count["I", second]:
        emit("W", second)
    while count["W", first] < count["I", first]:
        emit("W", first)
    return [a for a in ops if a.microbatch < m]


def _dualpipev_rank(rank: int, p: int, m: int) -> list[Action]:
    """DualPipeV order (DeepSeek-V3 2024, DualPipe; torch ``ScheduleDualPipeV``), F&B pairs sequential."""
    first, second = rank, 2 * p - 1 - rank
    count: dict[tuple[str, int], int] = defaultdict(int)
    pending_w: list[tuple[int, int]] = []
    ops: list[Action] = []

    def emit(kind: str, stage: int) -> None:
        counter = "I" if kind == "B" else kind
        mb = count[counter, stage]
        ops.append(Action(kind, stage, mb))
        count[counter, stage] += 1
        if kind == "I":
            pending_w.append((stage, mb))

    def emit_pending_w() -> None:
        if pending_w:
            stage, mb = pending_w.pop(0)
            ops.append(Action("W", stage, mb))

    _dualpipev_phases(rank, p, m, first, second, emit, emit_pending_w)
    return ops


def _dualpipev_phases(rank: int, p: int, m: int, first: int, second: int,
                      emit: Callable[[str, int], None], emit_pending_w: Callable[[], None]) -> None:
    for _ in range((p - rank - 1) * 2):  # 1: F on the first leg
        emit("F", first)
    for _ in range(rank + 1):  # 2: F0 F1
        emit("F", first)
        emit("F", second)
    for _ in range(p - rank - 1):  # 3: I1 W F1
        emit("I", second)
        emit_pending_w()
        emit("F", second)
    for _ in range(m - 2 * p + rank + 1):  # 4: main loop, (F0, B1) then (F1, B0)
        emit("F", first)
        emit("B", second)
        emit("F", second)
        emit("B", first)
    for _ in range(p - rank - 1):  # 5: B1, (F1, B0)
        emit("B", second)
        emit("F", second)
        emit("B", first)
    zero_bubble = False
    for i in range(rank + 1):  # 6: B1 B0, second half split into I/W
        if i == (rank + 1) // 2 and rank % 2 == 1:
            zero_bubble = True
        emit("I" if zero_bubble else "B", second)
        if i == (rank + 1) // 2 and rank % 2 == 0:
            zero_bubble = True
        emit("I" if zero_bubble else "B", first)
    for _ in range(p - rank - 1):  # 7: W, B0
        emit_pending_w()
        emit("I" if zero_bubble else "B", first)
    for _ in range(rank + 1):  # 8: remaining W
        emit_pending_w()


# ---- closed forms ---------------------------------------------------------------------------------

def bubble_fraction_gpipe(num_stages: int, num_microbatches: int) -> float:
    """(p-1)/(m+p-1) of the step is idle (Huang et al. 2019, GPipe, Sec. 2.2)."""
    return (num_stages - 1) / (num_microbatches + num_stages - 1)


def bubble_fraction_1f1b(num_stages: int, num_microbatches: int) -> float:
    """(p-1)/(m+p-1): same bubble as GPipe, fewer microbatches in flight (Narayanan et al. 2021, Sec. 2.2.1)."""
    return (num_stages - 1) / (num_microbatches + num_stages - 1)


def bubble_fraction_interleaved(num_stages: int, num_microbatches: int, num_virtual: int) -> float:
    """(p-1)/(v*m+p-1): bubble time shrinks by v (Narayanan et al. 2021, Sec. 2.2.2, needs m % p == 0)."""
    return (num_stages - 1) / (num_virtual * num_microbatches + num_stages - 1)


def idle_time_zb_h1(num_stages: int, forward_s: float, backward_input_s: float, backward_weight_s: float) -> float:
    """Idle time per rank of ZB-H1: (p-1)(T_F + T_B - T_W), T_B the input backward (Qi et al. 2023, Sec. 3.1).

    Holds for m >= p and T_W <= T_F; outside that regime use the simulator.
    """
    return (num_stages - 1) * (forward_s + backward_input_s - backward_weight_s)


def estimate_closed_form_bubble(schedule: str, num_stages: int, num_microbatches: int, num_virtual: int,
                                forward_s: float, backward_input_s: float, backward_weight_s: float) -> float:
    """Bubble fraction from the schedule's paper formula, for uniform stages and free communication.

    Times are per whole rank (all its virtual stages). ZB-H1's formula holds for T_W <= T_F (each W fits
    a slot an F would leave). ``zbv`` uses the same expression at chunk granularity (chunk times are half
    a rank's), which the torch ZB-V order attains for F = I = W. ``dualpipev`` uses DeepSeek-V3 Table 2,
    (p/2-1)(F&B + B - 3W) with chunk times and F&B = F + B since no overlap is modelled: an approximation.
    """
    p, m, v = num_stages, num_microbatches, num_virtual
    work = m * (forward_s + backward_input_s + backward_weight_s)
    if schedule in ("gpipe", "1f1b"):
        return bubble_fraction_1f1b(p, m)
    if schedule == "interleaved-1f1b":
        return bubble_fraction_interleaved(p, m, v)
    if schedule == "zb-h1":
        idle = idle_time_zb_h1(p, forward_s, backward_input_s, backward_weight_s)
    elif schedule == "zbv":
        idle = max(0.0, (p - 1) * (forward_s + backward_input_s - backward_weight_s) / 2)
    elif schedule == "dualpipev":
        f, b, w = forward_s / 2, (backward_input_s + backward_weight_s) / 2, backward_weight_s / 2
        idle = max(0.0, (p / 2 - 1) * ((f + b) + b - 3 * w))
    else:
        raise ValueError(f"unknown schedule {schedule!r}")
    return idle / (work + idle)
