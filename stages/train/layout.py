"""The 3D layout of the training ranks: a (pp, dp, tp) mesh, and which pipeline stages each
pipeline rank holds under a schedule. Pure arithmetic (no process group), shared with config
validation and testable on its own.

Global rank of mesh coordinate (pp, dp, tp), tp fastest (neighbouring ranks share a TP group,
the axis with the most traffic):

    rank = (pp * D + dp) * T + tp          D = data_parallel_size, T = tensor_parallel_size

Stage placement over S = p * v virtual stages (torch.distributed.pipelining's
``generate_stage_to_rank_mapping``):

- looped (gpipe, 1f1b, zb-h1 with v = 1; interleaved-1f1b): stage s on pipeline rank s mod p,
  so rank r holds r, r + p, r + 2p, ... (Narayanan et al. 2021, Sec. 2.2.2);
- V-shape (zbv, dualpipev; v = 2): stage s on rank s for s < p and on 2p - 1 - s after, so rank r
  holds r and 2p - 1 - r, and rank 0 holds both the embedding and the head (Qi et al. 2023, Sec. 6).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

__all__ = ["SCHEDULES", "V_SHAPED", "SPLIT_BACKWARD", "MeshCoord", "ParallelLayout", "schedule_error"]

SCHEDULES = ("gpipe", "1f1b", "interleaved-1f1b", "zb-h1", "zbv", "dualpipev")
V_SHAPED = ("zbv", "dualpipev")
SPLIT_BACKWARD = ("zb-h1", "zbv", "dualpipev")  # backward split into input (I) and weight (W) parts
_SINGLE_STAGE = ("gpipe", "1f1b", "zb-h1")


@dataclass(frozen=True)
class MeshCoord:
    """A training rank's place in the (pp, dp, tp) mesh."""

    pp: int
    dp: int
    tp: int


def schedule_error(schedule: str, pp: int, num_microbatches: int, virtual: int,
                   num_layers: Optional[int] = None) -> Optional[str]:
    """Why ``schedule`` cannot run p = ``pp`` ranks x v = ``virtual`` stages each over m =
    ``num_microbatches`` microbatches (per data-parallel rank), naming the setting to change; None
    when it can. The rules are torch's own (schedules.py in torch.distributed.pipelining)."""
    p, m, v = pp, num_microbatches, virtual
    key_v = "train.virtual_pipeline_model_parallel_size"
    if schedule not in SCHEDULES:
        return f"train.schedule={schedule!r} is not one of {', '.join(SCHEDULES)}"
    if p < 1 or m < 1 or v < 1:
        return (f"pipeline ranks ({p}), microbatches ({m}) and {key_v} ({v}) must all be >= 1")
    if schedule in _SINGLE_STAGE and v != 1:
        return f"train.schedule={schedule} runs one stage per pipeline rank: set {key_v}=1"
    if schedule in V_SHAPED and v != 2:
        return f"train.schedule={schedule} places exactly two stages per pipeline rank (a V): set {key_v}=2"
    if schedule == "interleaved-1f1b" and v < 2:
        return f"train.schedule=interleaved-1f1b needs {key_v} >= 2 (or use train.schedule=1f1b)"
    if num_layers is not None and num_layers < p * v:
        return (f"model.num_hidden_layers={num_layers} cannot be split into train.pipeline_model_parallel_size "
                f"x {key_v} = {p} x {v} = {p * v} stages: lower either or add layers")
    if schedule == "1f1b" and m < p:
        return (f"train.schedule=1f1b needs at least train.pipeline_model_parallel_size={p} microbatches per "
                f"data-parallel rank, got {m}: lower train.micro_batch_size")
    if schedule in ("interleaved-1f1b", "zb-h1"):
        rounds = max(1, m // p)  # torch: microbatches run in rounds of up to p
        if m % rounds:
            return (f"train.schedule={schedule} needs the microbatches per data-parallel rank ({m}) to be a "
                    f"multiple of {rounds} rounds (m // train.pipeline_model_parallel_size): use a multiple of {p}")
    if schedule == "dualpipev" and m < 2 * p:
        return (f"train.schedule=dualpipev needs at least 2 x train.pipeline_model_parallel_size = {2 * p} "
                f"microbatches per data-parallel rank, got {m}: lower train.micro_batch_size")
    return None


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
        if self.v_shaped and stage >= self.pp:
            return self.num_stages - 1 - stage
        return stage % self.pp

    def stages_of(self, pp_rank: int) -> tuple[int, ...]:
        """Virtual stages held by pipeline rank ``pp_rank``, ascending."""
        return tuple(s for s in range(self.num_stages) if self.stage_rank(s) == pp_rank)

    def stage_to_rank(self) -> dict[int, int]:
        return {s: self.stage_rank(s) for s in range(self.num_stages)}

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
