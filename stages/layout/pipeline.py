"""Pipeline arithmetic shared by the runtime and the planner: schedule names and the constraints
torch.distributed.pipelining puts on them, stage placement, and the layer split.

Stage placement over S = p * v virtual stages (torch's ``generate_stage_to_rank_mapping``):

- looped (gpipe, 1f1b, zb-h1 with v = 1; interleaved-1f1b): stage s on pipeline rank s mod p,
  so rank r holds r, r + p, r + 2p, ... (Narayanan et al. 2021, Sec. 2.2.2);
- V-shape (zbv, dualpipev; v = 2): stage s on rank s for s < p and on 2p - 1 - s after, so rank r
  holds r and 2p - 1 - r, and rank 0 holds both the embedding and the head (Qi et al. 2023, Sec. 6).

Layer split: L decoder layers over S stages, stage s holding n_s >= 1 of them in order. Even
(:func:`layer_ranges` without a split): as evenly as possible, earlier stages taking the remainder.
Balanced (:func:`balanced_layer_split`, train.layer_split=auto): the first stage also holds the
embedding (a gather: no FLOPs) and the last the final norm, lm_head and the loss's log-softmax,
worth ``head_layers`` decoder layers of forward + backward work, and the split minimises the
slowest stage's work max_s (n_s + [s = S - 1] * head_layers).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal, Optional, get_args

__all__ = ["ScheduleName", "SCHEDULES", "V_SHAPED", "SPLIT_BACKWARD", "schedule_error", "stage_to_rank",
           "layer_ranges", "layers_per_stage", "balanced_layer_split", "layer_split_error"]

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


def layer_ranges(num_layers: int, num_stages: int,
                 split: Optional[Sequence[int]] = None) -> list[tuple[int, int]]:
    """Contiguous [first, last) layer ranges of a pipeline split: ``split`` (layers per stage,
    :func:`layer_split_error` checks it), or None for the even one, earlier stages taking the remainder."""
    if not 1 <= num_stages <= num_layers:
        raise ValueError(f"cannot split {num_layers} layers into {num_stages} pipeline stages")
    if split is None:
        base, extra = divmod(num_layers, num_stages)
        split = [base + (1 if s < extra else 0) for s in range(num_stages)]
    error = layer_split_error(split, num_layers, num_stages)
    if error:
        raise ValueError(error)
    ranges, start = [], 0
    for size in split:
        ranges.append((start, start + size))
        start += size
    return ranges


def layers_per_stage(num_layers: int, num_stages: int) -> tuple[int, ...]:
    """Layers of each stage of :func:`layer_ranges` (e.g. 81 over 8: 11, 10, ..., 10)."""
    return tuple(last - first for first, last in layer_ranges(num_layers, num_stages))


def layer_split_error(split: Sequence[int], num_layers: Optional[int], num_stages: int) -> Optional[str]:
    """Why ``split`` (decoder layers per stage) is not a split of ``num_layers`` layers (None: not
    known yet) over ``num_stages`` = train.pipeline_model_parallel_size x virtual stages; None when
    it is. Every stage holds at least one layer, as the even split does (p * v <= layers)."""
    sizes = list(split)
    if len(sizes) != num_stages:
        return (f"train.layer_split={sizes} lists {len(sizes)} stages, the pipeline has {num_stages} "
                "(pipeline_model_parallel_size x virtual_pipeline_model_parallel_size): give one count per stage")
    if not all(isinstance(n, int) and not isinstance(n, bool) and n >= 1 for n in sizes):
        return f"train.layer_split={sizes} must give every stage a whole number of decoder layers >= 1"
    if num_layers is not None and sum(sizes) != num_layers:
        return (f"train.layer_split={sizes} holds {sum(sizes)} decoder layers, the model has "
                f"model.num_hidden_layers={num_layers}: make them sum to it (or set train.layer_split=auto)")
    return None


def balanced_layer_split(num_layers: int, num_stages: int, head_layers: float) -> tuple[int, ...]:
    """Layers per stage minimising the slowest stage's work max_s (n_s + [s = S - 1] * h), every
    n_s >= 1, where h = ``head_layers`` is the work of the head (final norm, lm_head, log-softmax)
    on the last stage in units of one decoder layer's (planner/training.py ``estimate_head_layers``).

    Greedy water-filling: from one layer per stage, each further layer goes to the stage whose work
    would be lowest after taking it, the earliest on ties. The costs are n_s plus a constant, so
    this reaches the least maximum (and, h = 0, the even split of :func:`layer_ranges`).
    30 layers over 2 stages, h = 7: the work is 37, 18.5 a stage; 19 / 11 (work 19 / 18).
    """
    if not 1 <= num_stages <= num_layers:
        raise ValueError(f"cannot split {num_layers} layers into {num_stages} pipeline stages")
    if not head_layers >= 0:
        raise ValueError(f"head_layers={head_layers} must be >= 0")
    counts = [1] * num_stages
    fixed = [0.0] * (num_stages - 1) + [float(head_layers)]
    for _ in range(num_layers - num_stages):
        s = min(range(num_stages), key=lambda i: (counts[i] + 1 + fixed[i], i))
        counts[s] += 1
    return tuple(counts)
