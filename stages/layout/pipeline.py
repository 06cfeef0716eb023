"""Pipeline arithmetic shared by the runtime and the planner: schedule names and the constraints
torch.distributed.pipelining puts on them, stage placement, and the layer split.

Stage placement over S = p * v virtual stages (torch's ``generate_stage_to_rank_mapping``):

- looped (gpipe, 1f1b, zb-h1 with v = 1; interleaved-1f1b): stage s on pipeline rank s mod p,
  so rank r holds r, r + p, r + 2p, ... (Narayanan et al. 2021, Sec. 2.2.2);
- V-shape (zbv, dualpipev; v = 2): stage s on rank s for s < p and on 2p - 1 - s after, so rank r
  holds r and 2p - 1 - r, and rank 0 holds both the embedding and the head (Qi et al. 2023, Sec. 6).

Layer split: L layers over S stages as evenly as possible, earlier stages taking the remainder.
"""

from __future__ import annotations

from typing import Literal, Optional, get_args

__all__ = ["ScheduleName", "SCHEDULES", "V_SHAPED", "SPLIT_BACKWARD", "schedule_error", "stage_to_rank",
           "layer_ranges", "layers_per_stage"]

ScheduleName = Literal["gpipe", "1f1b", "interleaved-1f1b", "zb-h1", "zbv", "dualpipev"]
SCHEDULES: tuple[str, ...] = get_args(ScheduleName)
V_SHAPED = ("zbv", "dualpipev")
SPLIT_BACKWARD = ("zb-h1", "zbv", "dualpipev")  # backward split into input (I) and weight (W) parts
_SINGLE_STAGE = ("gpipe", "1f1b", "zb-h1")


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


def stage_to_rank(schedule: str, pp: int, virtual: int) -> tuple[int, ...]:
    """Pipeline rank of each of the p * v virtual stages: looped, or a V for zbv / dualpipev."""
    total = pp * virtual
    if schedule in V_SHAPED:
        return tuple(s if s < pp else total - 1 - s for s in range(total))
    return tuple(s % pp for s in range(total))


def layer_ranges(num_layers: int, num_stages: int) -> list[tuple[int, int]]:
    """Contiguous [first, last) layer ranges of a pipeline split, earlier stages taking the remainder."""
    if not 1 <= num_stages <= num_layers:
        raise ValueError(f"cannot split {num_layers} layers into {num_stages} pipeline stages")
    base, extra = divmod(num_layers, num_stages)
    ranges, start = [], 0
    for s in range(num_stages):
        size = base + (1 if s < extra else 0)
        ranges.append((start, start + size))
        start += size
    return ranges


def layers_per_stage(num_layers: int, num_stages: int) -> tuple[int, ...]:
    """Layers of each stage of :func:`layer_ranges` (e.g. 81 over 8: 11, 10, ..., 10)."""
    return tuple(last - first for first, last in layer_ranges(num_layers, num_stages))
