"""Discrete-event simulation of a pipeline schedule's own action order.

Each rank executes its actions strictly in order (as torch's runtime does); an action starts when its
rank is free and its inputs have arrived:

- ``F(s, j)`` after ``F(s-1, j)`` finished, plus one p2p transfer when stage s-1 is on another rank;
- ``B/I(s, j)`` after ``F(s, j)`` and ``B/I(s+1, j)`` (plus p2p), and on the last stage after the
  forwards of every microbatch in j's loss group;
- ``W(s, j)`` after ``I(s, j)``.

Transfers are modelled as latency on the edge (asynchronous send/recv overlapping compute, as with
NCCL p2p on its own stream); they do not occupy the sending rank. A microbatch's activations count as
in flight on a stage from the start of its F to the end of its B (or of its W for split backwards:
the weight gradient still needs the saved inputs of the linear layers, so this is an upper bound).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import lru_cache

from planner.schedules import Action, PipelineOrder, build_pipeline_order

__all__ = [
    "ActionDurations",
    "SimEvent",
    "ScheduleSimulation",
    "ScheduleDeadlockError",
    "simulate_schedule",
    "simulate_pipeline_order",
    "simulate_peak_stash_bytes",
]

_KINDS = ("F", "B", "I", "W")


class ScheduleDeadlockError(RuntimeError):
    """The action order waits on an action that can never run (a schedule bug, never a user error)."""


@dataclass(frozen=True, kw_only=True)
class ActionDurations:
    """Seconds per action, uniform across stages unless ``per_stage`` overrides (virtual stage, kind).

    ``backward_s`` (full backward B) defaults to ``backward_input_s + backward_weight_s``. When a
    per-stage table gives B but a schedule needs I and W, they are taken as B/2 each (Qi et al. 2023
    measure T_I ~ T_W for transformer layers); when it gives I and W but B is needed, B = I + W.
    """

    forward_s: float = 1.0
    backward_input_s: float = 1.0
    backward_weight_s: float = 1.0
    backward_s: float | None = None
    p2p_s: float = 0.0
    """one activation (or activation-gradient) transfer between two pipeline ranks"""
    per_stage: Mapping[tuple[int, str], float] = field(default_factory=dict)

    @classmethod
    def from_means(cls, means: Mapping[tuple[int, str], float], *, p2p_s: float = 0.0) -> "ActionDurations":
        """Durations from measured means keyed ``(virtual stage, kind)``, e.g. a runtime timeline."""
        for stage, kind in means:
            if kind not in _KINDS:
                raise ValueError(f"duration key ({stage}, {kind!r}): kind must be one of {_KINDS}")
        return cls(per_stage=dict(means), p2p_s=p2p_s)

    def duration(self, stage: int, kind: str) -> float:
        """Seconds that ``kind`` takes on virtual ``stage``."""
        table = self.per_stage
        if (stage, kind) in table:
            return table[stage, kind]
        if kind == "B" and (stage, "I") in table and (stage, "W") in table:
            return table[stage, "I"] + table[stage, "W"]
        if kind in ("I", "W") and (stage, "B") in table:
            return table[stage, "B"] / 2
        if table and any(key[0] == stage for key in table):
            raise ValueError(f"no duration for action {kind} on stage {stage}; give ({stage}, {kind!r})")
        return {
            "F": self.forward_s,
            "I": self.backward_input_s,
            "W": self.backward_weight_s,
            "B": self.backward_s if self.backward_s is not None else self.backward_input_s + self.backward_weight_s,
        }[kind]


class SimEvent:
    """One executed action on one rank (plain slotted class: the simulator creates thousands)."""

    __slots__ = ("rank", "kind", "stage", "microbatch", "start_s", "end_s")

    def __init__(self, rank: int, kind: str, stage: int, microbatch: int, start_s: float, end_s: float) -> None:
        self.rank, self.kind, self.stage, self.microbatch = rank, kind, stage, microbatch
        self.start_s, self.end_s = start_s, end_s

    def __repr__(self) -> str:
        return f"SimEvent(rank={self.rank}, {self.stage}{self.kind}{self.microbatch}, {self.start_s:g}-{self.end_s:g})"


@dataclass(frozen=True)
class ScheduleSimulation:
    """Result of one simulated step of a schedule."""

    schedule: str
    num_ranks: int
    num_virtual: int
    num_microbatches: int
    makespan_s: float
    busy_s: tuple[float, ...]
    """compute seconds per rank"""
    events: tuple[SimEvent, ...] = field(repr=False, compare=False)
    stage_ranks: tuple[int, ...] = field(repr=False, default=())
    in_flight_profiles: tuple[tuple[tuple[int, ...], ...], ...] = field(repr=False, default=())
    """per rank: Pareto-maximal in-flight count vectors over the rank's stages (ascending stage index)"""

    def rank_stages(self, rank: int) -> list[int]:
        """Virtual stages held by ``rank``, ascending."""
        return [s for s, r in enumerate(self.stage_ranks) if r == rank]

    @property
    def idle_s(self) -> tuple[float, ...]:
        return tuple(self.makespan_s - b for b in self.busy_s)

    @property
    def bubble_fraction_per_rank(self) -> tuple[float, ...]:
        return tuple(i / self.makespan_s for i in self.idle_s)

    @property
    def bubble_fraction(self) -> float:
        """Idle share of the step, averaged over ranks: 1 - sum(busy) / (p * makespan)."""
        return 1.0 - sum(self.busy_s) / (self.num_ranks * self.makespan_s)

    @property
    def peak_in_flight_per_stage(self) -> tuple[int, ...]:
        """Most microbatches holding activations on each virtual stage at once."""
        peaks = [0] * len(self.stage_ranks)
        for rank, vectors in enumerate(self.in_flight_profiles):
            for vec in vectors:
                for count, stage in zip(vec, self.rank_stages(rank)):
                    peaks[stage] = max(peaks[stage], count)
        return tuple(peaks)

    @property
    def peak_in_flight_per_rank(self) -> tuple[float, ...]:
        """Most stage-microbatches in flight on a rank at once, in units of the rank's whole layer set."""
        return tuple(max((sum(vec) for vec in vectors), default=0) / self.num_virtual
                     for vectors in self.in_flight_profiles)


def simulate_schedule(schedule: str, num_stages: int, num_microbatches: int, num_virtual: int = 1,
                      durations: ActionDurations | Mapping[tuple[int, str], float] | None = None,
                      *, loss_group_microbatches: int = 1, keep_events: bool = True) -> ScheduleSimulation:
    """Simulate one training step of ``schedule`` on ``num_stages`` pipeline ranks.

    ``durations`` is an :class:`ActionDurations` or a mapping ``(virtual stage, kind) -> seconds`` of
    measured means (kinds F/B/I/W); ``None`` means 1 s per F, I and W (B = 2 s) and free transfers.
    ``keep_events=False`` drops the per-action timeline (the search keeps thousands of results).
    """
    if durations is None:
        durations = ActionDurations()
    elif not isinstance(durations, ActionDurations):
        durations = ActionDurations.from_means(durations)
    compiled = _compiled_order(schedule, num_stages, num_microbatches, num_virtual, loss_group_microbatches)
    return _run(compiled, durations, keep_events)


def simulate_pipeline_order(order: PipelineOrder, durations: ActionDurations, *,
                            keep_events: bool = True) -> ScheduleSimulation:
    """Run ``order`` in a discrete-event simulation; see the module docstring for the rules."""
    return _run(_compile(order), durations, keep_events)


# A compiled action: (action, tuple of (finish slot, crosses ranks) it waits on, finish slots it writes).
_Compiled = tuple[PipelineOrder, tuple[tuple[tuple[Action, tuple[tuple[int, bool], ...], tuple[int, ...]], ...], ...]]


@lru_cache(maxsize=2048)
def _compiled_order(schedule: str, p: int, m: int, v: int, group: int) -> _Compiled:
    return _compile(build_pipeline_order(schedule, p, m, v, loss_group_microbatches=group))


def _compile(order: PipelineOrder) -> _Compiled:
    """Resolve every action's dependencies to slots of one flat finish-time table (F | B-or-I | W)."""
    m, total, ranks_of = order.num_microbatches, order.num_stages_total, order.stage_ranks
    size = total * m
    f_slot, bi_slot, w_slot = (lambda s, j: s * m + j), (lambda s, j: size + s * m + j), (lambda s, j: 2 * size + s * m + j)
    k = order.loss_group_microbatches
    ranks = []
    for actions in order.rank_actions:
        compiled = []
        for action in actions:
            kind, stage, mb = action
            if kind == "F":
                deps = () if stage == 0 else ((f_slot(stage - 1, mb), ranks_of[stage - 1] != ranks_of[stage]),)
                writes: tuple[int, ...] = (f_slot(stage, mb),)
            elif kind == "W":
                deps, writes = ((bi_slot(stage, mb), False),), (w_slot(stage, mb),)
            else:
                deps = ((f_slot(stage, mb), False),)
                if stage == total - 1:
                    group = range((mb // k) * k, min((mb // k + 1) * k, m))
                    deps += tuple((f_slot(stage, j), False) for j in group if j != mb)
                else:
                    deps += ((bi_slot(stage + 1, mb), ranks_of[stage + 1] != ranks_of[stage]),)
                writes = (bi_slot(stage, mb), w_slot(stage, mb)) if kind == "B" else (bi_slot(stage, mb),)
            compiled.append((action, deps, writes))
        ranks.append(tuple(compiled))
    return order, tuple(ranks)


def _run(compiled: _Compiled, durations: ActionDurations, keep_events: bool) -> ScheduleSimulation:
    order, rank_actions = compiled
    num_ranks, p2p = order.num_ranks, durations.p2p_s
    kinds = {a.kind for actions in order.rank_actions for a in actions}
    cost = {(s, kind): durations.duration(s, kind) for s in range(order.num_stages_total) for kind in kinds}
    finish: list[float | None] = [None] * (3 * order.num_stages_total * order.num_microbatches)
    pointer, free_at, busy = [0] * num_ranks, [0.0] * num_ranks, [0.0] * num_ranks
    events: list[tuple[int, str, int, int, float, float]] = []
    remaining = sum(len(a) for a in rank_actions)
    while remaining:
        progressed = False
        for rank in range(num_ranks):
            actions, n = rank_actions[rank], len(rank_actions[rank])
            while pointer[rank] < n:
                action, deps, writes = actions[pointer[rank]]
                ready = free_at[rank]
                for slot, crosses in deps:
                    t = finish[slot]
                    if t is None:
                        break
                    if crosses:
                        t += p2p
                    if t > ready:
                        ready = t
                else:
                    end = ready + cost[action.stage, action.kind]
                    for slot in writes:
                        finish[slot] = end
                    events.append((rank, action.kind, action.stage, action.microbatch, ready, end))
                    busy[rank] += end - ready
                    free_at[rank] = end
                    pointer[rank] += 1
                    remaining -= 1
                    progressed = True
                    continue
                break
        if not progressed:
            stuck = {r: order.rank_actions[r][pointer[r]] for r in range(num_ranks)
                     if pointer[r] < len(order.rank_actions[r])}
            raise ScheduleDeadlockError(f"{order.schedule}: no rank can proceed; next actions {stuck}")
    profiles = _in_flight_profiles(order, events)
    kept = tuple(SimEvent(*e) for e in events) if keep_events else ()
    return ScheduleSimulation(order.schedule, num_ranks, order.num_virtual, order.num_microbatches,
                              max(free_at), tuple(busy), kept, order.stage_ranks, profiles)


def _in_flight_profiles(order: PipelineOrder,
                        events: list[tuple[int, str, int, int, float, float]]) -> tuple[tuple[tuple[int, ...], ...], ...]:
    """Per rank, the Pareto-maximal vectors of in-flight microbatch counts over its stages (ascending).

    A microbatch is in flight on a stage from its F start to the end of the B (or W) that frees it;
    releases at time t happen before allocations at t. Any peak of a non-negative weighting of the
    counts (e.g. bytes per stage) is reached at one of these vectors.
    """
    local_index: dict[int, int] = {}
    for rank in range(order.num_ranks):
        for i, stage in enumerate(s for s, r in enumerate(order.stage_ranks) if r == rank):
            local_index[stage] = i
    points: list[list[tuple[float, int, int]]] = [[] for _ in range(order.num_ranks)]
    for rank, kind, stage, _, start, end in events:
        if kind == "F":
            points[rank].append((start, 1, local_index[stage]))
        elif kind == "W" or kind == "B":
            points[rank].append((end, 0, local_index[stage]))
    profiles = []
    for rank_points in points:
        counts = [0] * order.num_virtual
        best_total, seen = -1, set()
        for _, is_alloc, index in sorted(rank_points):
            if is_alloc:
                counts[index] += 1
                if order.num_virtual == 1:
                    best_total = max(best_total, counts[0])
                else:
                    seen.add(tuple(counts))
            else:
                counts[index] -= 1
        profiles.append(((best_total,),) if order.num_virtual == 1 else _pareto_maximal(seen))
    return tuple(profiles)


def _pareto_maximal(vectors: set[tuple[int, ...]]) -> tuple[tuple[int, ...], ...]:
    kept: list[tuple[int, ...]] = []
    for vec in sorted(vectors, key=sum, reverse=True):
        if not any(all(a >= b for a, b in zip(other, vec)) for other in kept):
            kept.append(vec)
    return tuple(sorted(kept))


def simulate_peak_stash_bytes(sim: ScheduleSimulation, bytes_per_stage: Mapping[int, float]) -> tuple[float, ...]:
    """Peak activation-stash bytes per rank: max over time of sum(in-flight microbatches x stage bytes)."""
    peaks = []
    for rank, vectors in enumerate(sim.in_flight_profiles):
        stages = sim.rank_stages(rank)
        peaks.append(max((sum(c * float(bytes_per_stage[s]) for c, s in zip(vec, stages)) for vec in vectors),
                         default=0.0))
    return tuple(peaks)
