"""The whole plan for one config: the configured layout plus the comparisons the design report needs."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from planner.config import PlanConfig, PlanConfigError
from planner.layout import LayoutEstimate, estimate_layout, estimate_step_for_staleness, layout_label
from planner.memory import estimate_kv_cache_bytes
from planner.rollout import RolloutEstimate, WeightSyncEstimate, estimate_rollout, estimate_weight_sync
from planner.schedules import estimate_closed_form_bubble
from planner.search import SCHEDULE_VARIANTS, Candidate, SearchResult, search_layouts
from planner.simulator import ActionDurations, ScheduleSimulation, simulate_peak_stash_bytes, simulate_schedule
from planner.staleness import StalenessEstimate, estimate_staleness
from planner.steptime import StepTimeEstimate
from planner.training import estimate_stage_activation_bytes, estimate_stage_layout

__all__ = [
    "Plan",
    "ScheduleRow",
    "GroupBarrierRow",
    "MicrobatchRow",
    "KVSummary",
    "RolloutVariant",
    "SyncVariant",
    "StalenessRow",
    "build_plan",
]

_STALENESS_RANGE = range(0, 9)
_GROUP_BARRIERS = (1, 2, 4, 8, 16)
_MICRO_BATCHES = (1, 2, 4, 8)
_RECOMPUTES = ("none", "selective", "full")


@dataclass(frozen=True)
class ScheduleRow:
    schedule: str
    num_virtual: int
    error: str | None
    closed_form_bubble: float = 0.0
    simulated_bubble: float = 0.0
    pipeline_s: float = 0.0
    peak_in_flight_first: float = 0.0
    peak_in_flight_last: float = 0.0
    peak_memory_bytes: float = 0.0
    fits: bool = False
    simulation: ScheduleSimulation | None = None
    durations: ActionDurations | None = None


@dataclass(frozen=True)
class GroupBarrierRow:
    """1F1B when the loss of a microbatch needs ``microbatches`` forwards first (in-pipeline group sync)."""

    microbatches: int
    bubble: float
    makespan_s: float
    peak_in_flight_first: int
    peak_in_flight_last: int
    stash_bytes_last_rank: float
    stash_bytes_first_rank: float


@dataclass(frozen=True)
class MicrobatchRow:
    micro_batch_size: int
    recompute: str
    error: str | None
    peak_memory_bytes: float = 0.0
    activation_first_bytes: float = 0.0
    activation_last_bytes: float = 0.0
    train_s: float = 0.0
    fits: bool = False


@dataclass(frozen=True)
class KVSummary:
    per_token_bytes: int
    step_shared_bytes: int
    step_unshared_bytes: int
    step_paged_bytes: int
    per_group_bytes: int


@dataclass(frozen=True)
class RolloutVariant:
    name: str
    batching: str
    speculative: bool
    mean_gen_len: int
    rollout: RolloutEstimate


@dataclass(frozen=True)
class SyncVariant:
    placement: str
    mode: str
    in_flight: bool
    sync: WeightSyncEstimate


@dataclass(frozen=True)
class StalenessRow:
    drift: StalenessEstimate
    step: StepTimeEstimate | None
    """best decoupled layout at this staleness (None without a search)"""


@dataclass(frozen=True)
class Plan:
    config: PlanConfig
    layout: LayoutEstimate
    schedules: tuple[ScheduleRow, ...]
    group_barriers: tuple[GroupBarrierRow, ...]
    microbatches: tuple[MicrobatchRow, ...]
    kv: KVSummary
    rollout_variants: tuple[RolloutVariant, ...]
    sync_variants: tuple[SyncVariant, ...]
    staleness: tuple[StalenessRow, ...]
    search: SearchResult | None
    best_colocated: Candidate | None
    best_decoupled_sync: Candidate | None
    best_decoupled_async: Candidate | None

    @property
    def label(self) -> str:
        return layout_label(self.config)


def _with_train(cfg: PlanConfig, **changes) -> PlanConfig:
    return dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, **changes))


def _schedule_rows(cfg: PlanConfig) -> tuple[ScheduleRow, ...]:
    rows = []
    p = cfg.train.pipeline_model_parallel_size
    for schedule, v in SCHEDULE_VARIANTS:
        try:
            variant = _with_train(cfg, schedule=schedule, virtual_pipeline_model_parallel_size=v)
        except PlanConfigError as exc:
            rows.append(ScheduleRow(schedule, v, str(exc)))
            continue
        est = estimate_layout(variant)
        sim = est.train_step.simulation
        d = est.train_step.durations
        ranks = range(p * v)
        # closed form with the rank-mean times of this layout (uniform-stage assumption of the formulas)
        f, i, w = (sum(d.duration(s, k) for s in ranks) / p for k in ("F", "I", "W"))
        rows.append(ScheduleRow(
            schedule, v, None, estimate_closed_form_bubble(schedule, p, variant.num_microbatches, v, f, i, w),
            sim.bubble_fraction, est.train_step.pipeline_s, est.memory[0].peak_in_flight,
            est.memory[-1].peak_in_flight, est.peak_training_bytes, est.rejection is None, sim, d))
    return tuple(rows)


def _group_barrier_rows(cfg: PlanConfig, est: LayoutEstimate) -> tuple[GroupBarrierRow, ...]:
    p, m = cfg.train.pipeline_model_parallel_size, cfg.num_microbatches
    one_f_one_b = _with_train(cfg, schedule="1f1b", virtual_pipeline_model_parallel_size=1)
    layout = estimate_stage_layout(cfg.model_shape, one_f_one_b.train, cfg.seq_len)
    stage_bytes = estimate_stage_activation_bytes(cfg.model_shape, one_f_one_b.train, cfg.seq_len, layout)
    durations = estimate_layout(one_f_one_b).train_step.durations
    rows = []
    for k in _GROUP_BARRIERS:
        if k > m:
            break
        sim = simulate_schedule("1f1b", p, m, 1, durations, loss_group_microbatches=k, keep_events=False)
        stash = simulate_peak_stash_bytes(sim, stage_bytes)
        peaks = sim.peak_in_flight_per_stage
        rows.append(GroupBarrierRow(k, sim.bubble_fraction, sim.makespan_s, peaks[0], peaks[-1], stash[-1], stash[0]))
    return tuple(rows)


def _microbatch_rows(cfg: PlanConfig) -> tuple[MicrobatchRow, ...]:
    rows = []
    for mbs in _MICRO_BATCHES:
        for recompute in _RECOMPUTES:
            try:
                variant = _with_train(cfg, micro_batch_size=mbs, recompute=recompute)
            except PlanConfigError as exc:
                rows.append(MicrobatchRow(mbs, recompute, str(exc)))
                continue
            est = estimate_layout(variant, max_simulated_microbatches=1)
            rows.append(MicrobatchRow(mbs, recompute, None, est.peak_training_bytes, est.memory[0].activation_bytes,
                                      est.memory[-1].activation_bytes, est.train_step.total_s,
                                      est.rejection is None))
    return tuple(rows)


def _kv_summary(cfg: PlanConfig) -> KVSummary:
    model, wl, ro = cfg.model_shape, cfg.workload, cfg.rollout
    args = (model, wl.prompts_per_step, wl.group_size, wl.prompt_len, wl.gen_len, ro.kv_dtype_bytes)
    return KVSummary(
        per_token_bytes=2 * model.num_hidden_layers * model.kv_dim * ro.kv_dtype_bytes,
        step_shared_bytes=estimate_kv_cache_bytes(*args, share_prefix=True),
        step_unshared_bytes=estimate_kv_cache_bytes(*args, share_prefix=False),
        step_paged_bytes=estimate_kv_cache_bytes(*args, share_prefix=True, page_size=ro.page_size),
        per_group_bytes=estimate_kv_cache_bytes(model, 1, wl.group_size, wl.prompt_len, wl.gen_len,
                                                ro.kv_dtype_bytes, True, ro.page_size),
    )


def _rollout_variants(est: LayoutEstimate) -> tuple[RolloutVariant, ...]:
    cfg = est.config
    wl = cfg.workload
    resident = est.rollout.resident_bytes_per_gpu
    half = max(1, wl.gen_len // 2)
    variants = [
        ("static (synchronised), all to gen_len", "static", False, wl.gen_len),
        ("static, mean gen_len/2", "static", False, half),
        ("continuous, mean gen_len/2", "continuous", False, half),
        ("continuous + speculative, mean gen_len/2", "continuous", True, half),
        ("static + speculative, all to gen_len", "static", True, wl.gen_len),
    ]
    rows = []
    for name, batching, speculative, mean in variants:
        ro = dataclasses.replace(cfg.rollout, batching=batching,
                                 speculative_draft_tokens=(cfg.rollout.speculative_draft_tokens or 4) if speculative else 0)
        variant = dataclasses.replace(cfg, rollout=ro, workload=dataclasses.replace(wl, mean_gen_len=mean))
        rows.append(RolloutVariant(name, batching, speculative, mean,
                                   estimate_rollout(variant, variant.rollout_gpus, resident)))
    return tuple(rows)


def _sync_variants(estimates: list[LayoutEstimate]) -> tuple[SyncVariant, ...]:
    rows = []
    for est in estimates:
        cfg = est.config
        for mode in ("recompute", "keep", "drain"):
            variant = dataclasses.replace(cfg, rollout=dataclasses.replace(cfg.rollout, kv_on_weight_sync=mode))
            in_flight = cfg.rollout.placement == "decoupled"
            rows.append(SyncVariant(cfg.rollout.placement, mode, in_flight,
                                    estimate_weight_sync(variant, est.rollout, in_flight=in_flight)))
    return tuple(rows)


def _best(search: SearchResult | None, placement: str, staleness: int, min_headroom: float) -> Candidate | None:
    """Fastest candidate of ``placement`` at ``staleness``, among those leaving ``min_headroom`` of the cap free
    (all candidates when none does)."""
    if search is None:
        return None
    options = [c for c in search.feasible if c.config.rollout.placement == placement]
    roomy = [c for c in options
             if c.estimate.peak_training_bytes <= (1 - min_headroom) * c.config.cluster.memory_cap_bytes]
    key = (lambda c: c.step_s_sync) if staleness == 0 else (lambda c: c.step_s_async)
    return min(roomy or options, key=key, default=None)


def build_plan(cfg: PlanConfig) -> Plan:
    """Evaluate ``cfg`` and every comparison the report needs (search included when enabled)."""
    layout = estimate_layout(cfg)
    search = search_layouts(cfg) if cfg.search.enabled else None
    margin = cfg.search.min_headroom_fraction
    best_col, best_sync, best_async = (_best(search, "colocated", 0, margin), _best(search, "decoupled", 0, margin),
                                       _best(search, "decoupled", 1, margin))
    ro = cfg.rollout
    staleness_rows = []
    for k in _STALENESS_RANGE:
        drift = estimate_staleness(k, sigma_step=ro.logratio_std_per_step, sigma_mismatch=ro.logratio_std_mismatch,
                                   eps_low=cfg.train.clip_eps_low, eps_high=cfg.train.clip_eps_high,
                                   gen_len=cfg.workload.gen_len, hot_share=ro.drift_hot_token_share,
                                   hot_multiplier=ro.drift_hot_std_multiplier,
                                   updates_per_step=cfg.workload.num_samples // cfg.global_batch_size)
        base = best_async if k >= 1 else best_sync
        step = estimate_step_for_staleness(base.estimate, k) if base is not None else None
        staleness_rows.append(StalenessRow(drift, step))
    sync_sources = [layout] + [c.estimate for c in (best_async,) if c is not None
                               and c.config.rollout.placement != cfg.rollout.placement]
    return Plan(
        config=cfg, layout=layout, schedules=_schedule_rows(cfg), group_barriers=_group_barrier_rows(cfg, layout),
        microbatches=_microbatch_rows(cfg), kv=_kv_summary(cfg), rollout_variants=_rollout_variants(layout),
        sync_variants=_sync_variants(sync_sources), staleness=tuple(staleness_rows), search=search,
        best_colocated=best_col, best_decoupled_sync=best_sync, best_decoupled_async=best_async,
    )
