"""Layout search: TP, PP, DP, virtual stages, schedule, micro-batch, recompute, rollout/training split,
and the inference engines' TP.

Every candidate is built as a :class:`PlanConfig` (so it passes the same validation as a user config),
screened by its static memory (weights, the frozen reference, grads and optimiser, which no schedule
can shrink), then evaluated with :func:`estimate_layout` (simulated schedule, extrapolated past
4*p*v microbatches).
Each rejected candidate keeps the one-line reason it fails.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass

from planner.config import PlanConfig, PlanConfigError
from planner.constants import BF16_BYTES, GIB
from planner.layout import (
    LayoutEstimate,
    estimate_layout,
    estimate_step_for_staleness,
    layout_label,
    training_memory_rejection,
)
from planner.memory import estimate_optimizer_bytes, estimate_stage_parameters
from planner.training import estimate_stage_layout, estimate_training_memory, reference_parameters

__all__ = ["Candidate", "Rejection", "SearchResult", "search_layouts", "SCHEDULE_VARIANTS"]

SCHEDULE_VARIANTS: tuple[tuple[str, int], ...] = (
    ("gpipe", 1), ("1f1b", 1), ("zb-h1", 1), ("interleaved-1f1b", 2), ("interleaved-1f1b", 4),
    ("zbv", 2), ("dualpipev", 2),
)
_TP_CHOICES = (1, 2, 4, 8)
_MICRO_BATCH_CHOICES = (1, 2, 4, 8)
_MAX_PIPELINE_SIZE = 16  # deeper pipelines only add bubble and hops at these scales; keeps the search in seconds
_RECOMPUTE_CHOICES = ("none", "selective", "full")
_ROLLOUT_TP_CHOICES = (1, 2, 4, 8)
_SIMULATION_CAP = 1  # simulate the fewest microbatches that reach steady state (4*p*v), extrapolate the rest


@dataclass(frozen=True, slots=True)
class Candidate:
    """A feasible layout with its step times at staleness 0 and at the configured staleness (and 1)."""

    label: str
    estimate: LayoutEstimate
    step_s: float
    """step time at the configured staleness"""
    step_s_sync: float
    """step time at staleness 0"""
    step_s_async: float
    """step time at staleness 1 (equals step_s_sync when colocated)"""

    @property
    def config(self) -> PlanConfig:
        return self.estimate.config


@dataclass(frozen=True, slots=True)
class Rejection:
    label: str
    reason: str
    kind: str
    """'constraint' (impossible combination), 'dominated', 'static-memory', 'memory' or 'rollout'"""
    overage: float = 0.0
    """bytes over the cap (memory rejections), to list near misses first"""


@dataclass(frozen=True)
class SearchResult:
    feasible: tuple[Candidate, ...]
    """fastest first"""
    rejected: tuple[Rejection, ...]
    """near misses first"""
    evaluated: int

    def top(self, k: int) -> tuple[Candidate, ...]:
        return self.feasible[:k]

    @property
    def rejection_counts(self) -> dict[str, int]:
        return dict(Counter(r.kind for r in self.rejected))

    def best_by_split(self, staleness: int, min_headroom: float = 0.0) -> dict[tuple[str, int], Candidate]:
        """Fastest candidate per (placement, rollout GPUs) at staleness 0 or 1, preferring those that leave
        ``min_headroom`` of the memory cap free."""
        def time(c: Candidate) -> float:
            return c.step_s_sync if staleness == 0 else c.step_s_async

        def roomy(c: Candidate) -> bool:
            return c.estimate.peak_training_bytes <= (1 - min_headroom) * c.config.cluster.memory_cap_bytes

        best: dict[tuple[str, int], Candidate] = {}
        for cand in self.feasible:
            key = (cand.config.rollout.placement, cand.config.rollout_gpus)
            held = best.get(key)
            if held is None or (roomy(cand), -time(cand)) > (roomy(held), -time(held)):
                best[key] = cand
        return best


def _placements(cfg: PlanConfig) -> Iterator[tuple[str, int | None]]:
    yield "colocated", None
    step = max(cfg.cluster.gpus_per_node, cfg.rollout.rollout_tensor_parallel_size)
    for gpus in range(step, cfg.cluster.num_gpus, step):
        yield "decoupled", gpus


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _candidate_configs(cfg: PlanConfig) -> Iterator[tuple[str, PlanConfig | PlanConfigError]]:
    for placement, rollout_gpus in _placements(cfg):
        rollout = dataclasses.replace(cfg.rollout, placement=placement, rollout_gpus=rollout_gpus)
        training_gpus = cfg.cluster.num_gpus - (rollout_gpus or 0)
        for tp in _TP_CHOICES:
            if training_gpus % tp:
                continue
            for pp in (d for d in _divisors(training_gpus // tp) if d <= _MAX_PIPELINE_SIZE):
                dp = training_gpus // (tp * pp)
                for schedule, v in SCHEDULE_VARIANTS:
                    for mbs in _MICRO_BATCH_CHOICES:
                        for recompute in _RECOMPUTE_CHOICES:
                            train = dict(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                                         data_parallel_size=dp, virtual_pipeline_model_parallel_size=v,
                                         micro_batch_size=mbs, schedule=schedule, recompute=recompute)
                            yield _build(cfg, rollout, train)


def _build(cfg: PlanConfig, rollout, train: dict) -> tuple[str, PlanConfig | PlanConfigError]:
    t = train
    placement = "colocated" if rollout.placement == "colocated" else f"decoupled {rollout.rollout_gpus}R"
    label = (f"TP{t['tensor_model_parallel_size']} PP{t['pipeline_model_parallel_size']} "
             f"DP{t['data_parallel_size']} {t['schedule']} v{t['virtual_pipeline_model_parallel_size']} "
             f"mbs{t['micro_batch_size']} {t['recompute']} | {placement}")
    try:
        return label, dataclasses.replace(cfg, rollout=rollout, train=dataclasses.replace(cfg.train, **train))
    except PlanConfigError as exc:
        return label, exc


def _static_memory_bytes(cfg: PlanConfig) -> float:
    """Weights + the frozen reference's stages + grads + optimiser of the heaviest pipeline rank: a
    floor no schedule or recompute lowers."""
    model, train = cfg.model_shape, cfg.train
    layout = estimate_stage_layout(model, train, cfg.seq_len)
    worst = 0.0
    for rank in range(layout.num_ranks):
        params = sum(estimate_stage_parameters(model, layout.layers[s], has_embedding=s == 0,
                                               has_head=s == layout.last,
                                               tensor_parallel_size=train.tensor_model_parallel_size,
                                               single_stage=len(layout.layers) == 1,
                                               tp_rules=train.tensor_parallel_rules)
                     for s, r in enumerate(layout.ranks) if r == rank)
        reference = reference_parameters(model, train, params)
        total = params * (BF16_BYTES + train.grad_dtype_bytes) + reference * BF16_BYTES + estimate_optimizer_bytes(
            params, train.data_parallel_size, train.distributed_optimizer)
        worst = max(worst, total)
    return worst


def _best_rollout_engine(cfg: PlanConfig) -> LayoutEstimate:
    """Evaluate ``cfg`` with each inference-engine TP that fits; keep the fastest step (the configured TP on ties)."""
    first = estimate_layout(cfg, max_simulated_microbatches=_SIMULATION_CAP)
    best = first
    for tp in _ROLLOUT_TP_CHOICES:
        if tp == cfg.rollout.rollout_tensor_parallel_size or tp > cfg.cluster.gpus_per_node:
            continue
        try:
            variant = dataclasses.replace(cfg, rollout=dataclasses.replace(cfg.rollout, rollout_tensor_parallel_size=tp))
        except PlanConfigError:
            continue
        est = estimate_layout(variant, reuse=first)
        if est.rejection is None and (best.rejection is not None or est.step.step_s < best.step.step_s):
            best = est
    return best


def search_layouts(cfg: PlanConfig) -> SearchResult:
    """Evaluate every layout of the cluster for ``cfg``'s model and workload; fastest feasible first."""
    cap = cfg.cluster.memory_cap_bytes
    feasible: list[Candidate] = []
    rejected: list[Rejection] = []
    evaluated = 0
    for label, candidate in _candidate_configs(cfg):
        evaluated += 1
        if isinstance(candidate, PlanConfigError):
            rejected.append(Rejection(label, str(candidate), "constraint"))
            continue
        if candidate.train.recompute == "selective" and candidate.train.attention == "flash":
            rejected.append(Rejection(label, "selective recompute saves nothing with flash attention (no s x s "
                                      "scores are kept) and recomputes the attention forward; use recompute=none",
                                      "dominated"))
            continue
        static = _static_memory_bytes(candidate)
        if static > cap:
            rejected.append(Rejection(label, f"weights + frozen reference + grads + optimiser alone need {static / GIB:.1f} GiB per GPU "
                                      f"> {cap / GIB:.1f} GiB cap; raise TP*PP or DP (distributed optimiser)",
                                      "static-memory", static - cap))
            continue
        memory = estimate_training_memory(candidate)
        peak = max(memory, key=lambda m: m.total_bytes)
        if peak.total_bytes > cap:
            rejected.append(Rejection(layout_label(candidate), training_memory_rejection(memory, cap), "memory",
                                      peak.total_bytes - cap))
            continue
        est = _best_rollout_engine(candidate)
        reason = est.rejection
        if reason is not None:
            rejected.append(Rejection(layout_label(candidate), reason, "rollout"))
            continue
        sync = estimate_step_for_staleness(est, 0).step_s
        async_ = estimate_step_for_staleness(est, 1).step_s if candidate.rollout.placement == "decoupled" else sync
        feasible.append(Candidate(layout_label(est.config), est, est.step.step_s, sync, async_))
    feasible.sort(key=lambda c: (c.step_s, c.estimate.peak_training_bytes))
    order = {"memory": 0, "rollout": 1, "static-memory": 2, "dominated": 3, "constraint": 4}
    rejected.sort(key=lambda r: (order[r.kind], r.overage))
    return SearchResult(tuple(feasible), tuple(rejected), evaluated)
