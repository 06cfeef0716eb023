"""The (pp, dp, tp) mesh of the training ranks. Pure arithmetic (no process group).

Global rank of mesh coordinate (pp, dp, tp), tp fastest (neighbouring ranks share a TP group,
the axis with the most traffic; Megatron's order, so the planner's node boundaries are the runtime's):

    rank = (pp * D + dp) * T + tp          D = data_parallel_size, T = tensor_parallel_size
"""

from __future__ import annotations

from dataclasses import dataclass

from stages.layout.pipeline import SCHEDULES, V_SHAPED, stage_to_rank

__all__ = ["MeshCoord", "ParallelLayout"]


@dataclass(frozen=True)
class MeshCoord:
    """A training rank's place in the (pp, dp, tp) mesh."""

    pp: int
    dp: int
    tp: int


@dataclass(frozen=True)
class ParallelLayout:
    """pp x dp x tp training ranks; each pipeline rank holds ``virtual`` stages under ``schedule``."""

    pp: int = 1
    dp: int = 1
    tp: int = 1
    virtual: int = 1
    schedule: str = "1f1b"

    def __post_init__(self) -> None:
        for name in ("pp", "dp", "tp", "virtual"):
            if getattr(self, name) < 1:
                raise ValueError(f"ParallelLayout.{name}={getattr(self, name)} must be >= 1")
        if self.schedule not in SCHEDULES:
            raise ValueError(f"schedule={self.schedule!r} is not one of {', '.join(SCHEDULES)}")

    @property
    def world_size(self) -> int:
        return self.pp * self.dp * self.tp

    @property
    def num_stages(self) -> int:
        """Virtual stages of the whole pipeline, p * v."""
        return self.pp * self.virtual

    @property
    def v_shaped(self) -> bool:
        return self.schedule in V_SHAPED

    def coord(self, rank: int) -> MeshCoord:
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} is outside a world of {self.world_size} training ranks")
        tp = rank % self.tp
        dp = (rank // self.tp) % self.dp
        return MeshCoord(rank // (self.tp * self.dp), dp, tp)

    def rank_of(self, coord: MeshCoord) -> int:
        return (coord.pp * self.dp + coord.dp) * self.tp + coord.tp

    def stage_rank(self, stage: int) -> int:
        """The pipeline rank holding virtual stage ``stage``."""
        return stage_to_rank(self.schedule, self.pp, self.virtual)[stage]

    def stages_of(self, pp_rank: int) -> tuple[int, ...]:
        """Virtual stages held by pipeline rank ``pp_rank``, ascending."""
        return tuple(s for s, r in enumerate(stage_to_rank(self.schedule, self.pp, self.virtual)) if r == pp_rank)

    def stage_to_rank(self) -> dict[int, int]:
        return dict(enumerate(stage_to_rank(self.schedule, self.pp, self.virtual)))

    @property
    def output_rank(self) -> int:
        """The rank whose forward-only passes return the step's gathered log-probs (and write them):
        the last stage's holder at dp = tp = 0 (pipeline rank 0 for a V-shaped schedule)."""
        return self.rank_of(MeshCoord(self.stage_rank(self.num_stages - 1), 0, 0))

    def axis_groups(self, axis: str) -> list[list[int]]:
        """Every group of global ranks along mesh axis ``axis`` (pp, dp or tp), in a fixed order:
        process groups must be created by every rank in the same order."""
        sizes = {"pp": self.pp, "dp": self.dp, "tp": self.tp}
        if axis not in sizes:
            raise ValueError(f"mesh axis {axis!r} is not one of pp, dp, tp")
        others = [a for a in ("pp", "dp", "tp") if a != axis]
        groups = []
        for i in range(sizes[others[0]]):
            for j in range(sizes[others[1]]):
                fixed = {others[0]: i, others[1]: j}
                groups.append([self.rank_of(MeshCoord(**fixed, **{axis: k})) for k in range(sizes[axis])])
        return groups

    def tied_groups(self) -> list[list[int]]:
        """Pairs of global ranks holding the first and the last stage (the two copies of a tied
        embedding), one pair per (dp, tp); empty when one pipeline rank holds both."""
        first, last = self.stage_rank(0), self.stage_rank(self.num_stages - 1)
        if first == last:
            return []
        return [[self.rank_of(MeshCoord(first, d, t)), self.rank_of(MeshCoord(last, d, t))]
                for d in range(self.dp) for t in range(self.tp)]
