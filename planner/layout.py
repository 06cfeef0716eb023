"""One layout evaluated end to end: training step and memory, rollout, weight sync, step time, fit."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from planner.config import PlanConfig
from planner.constants import GIB
from planner.rollout import RolloutEstimate, WeightSyncEstimate, estimate_rollout, estimate_weight_sync
from planner.steptime import StepTimeEstimate, estimate_step_time
from planner.training import (
    TrainingMemory,
    TrainStepEstimate,
    estimate_reference_pass_s,
    estimate_train_step,
    estimate_training_memory,
)

__all__ = ["LayoutEstimate", "estimate_layout", "estimate_step_for_staleness", "layout_label",
           "training_memory_rejection"]


@dataclass(frozen=True)
class LayoutEstimate:
    """Everything the planner predicts for one :class:`PlanConfig`."""

    config: PlanConfig
    train_step: TrainStepEstimate
    memory: tuple[TrainingMemory, ...]
    rollout: RolloutEstimate
    weight_sync: WeightSyncEstimate
    reference_s: float
    offload_s: float
    step: StepTimeEstimate

    @property
    def peak_training_bytes(self) -> float:
        return max(m.total_bytes for m in self.memory)

    @property
    def rejection(self) -> str | None:
        """Why this layout does not fit, with the numbers; None when it does."""
        cap = self.config.cluster.memory_cap_bytes
        if self.peak_training_bytes > cap:
            return training_memory_rejection(self.memory, cap)
        if not self.rollout.feasible:
            r = self.rollout
            room = cap - r.weights_bytes_per_gpu - r.resident_bytes_per_gpu - r.workspace_bytes_per_gpu
            return (f"rollout: engine weights {r.weights_bytes_per_gpu / GIB:.1f} GiB + resident training state "
                    f"{r.resident_bytes_per_gpu / GIB:.1f} GiB leave {max(room, 0) / GIB:.1f} GiB, less than one "
                    f"group's KV cache ({r.kv_bytes_per_group_per_gpu / GIB:.1f} GiB per GPU)")
        return None


def training_memory_rejection(memory: tuple[TrainingMemory, ...], cap: float) -> str:
    """One line naming the rank over the cap and what fills it."""
    worst = max(memory, key=lambda m: m.total_bytes)
    over = worst.total_bytes - cap
    by = f"{over / GIB:.1f} GiB" if over >= GIB else f"{over / 2**20:.0f} MiB"
    return (f"training memory {worst.total_bytes / GIB:.1f} GiB on pipeline rank {worst.rank} exceeds the "
            f"{cap / GIB:.1f} GiB cap by {by} (activations {worst.activation_bytes / GIB:.1f} GiB for "
            f"{worst.peak_in_flight:g} microbatches in flight, optimiser {worst.optimizer_bytes / GIB:.1f} GiB); "
            "use more recompute, a smaller micro-batch or more PP/TP")


def layout_label(cfg: PlanConfig) -> str:
    """Short name: ``TP4 PP8 DP2 1f1b v1 mbs1 selective | colocated rTP4`` (GPU split when decoupled)."""
    t = cfg.train
    placement = (cfg.rollout.placement if cfg.rollout.placement == "colocated"
                 else f"decoupled {cfg.rollout_gpus}R/{cfg.training_gpus}T")
    placement += f" rTP{cfg.rollout.rollout_tensor_parallel_size}"
    return (f"TP{t.tensor_model_parallel_size} PP{t.pipeline_model_parallel_size} DP{t.data_parallel_size} "
            f"{t.schedule} v{t.virtual_pipeline_model_parallel_size} mbs{t.micro_batch_size} {t.recompute} | {placement}")


def _resident_rollout_bytes(cfg: PlanConfig, memory: tuple[TrainingMemory, ...]) -> float:
    """Training state left on a GPU while it generates (colocated only): weights, the frozen
    reference, grads, maybe optimiser."""
    if cfg.rollout.placement == "decoupled":
        return 0.0
    keep_optimizer = not cfg.rollout.offload_optimizer
    return max(m.resident_bytes - (0.0 if keep_optimizer else m.optimizer_bytes) for m in memory)


def estimate_step_for_staleness(est: LayoutEstimate, staleness: int) -> StepTimeEstimate:
    """The same layout's step time at another staleness (in-flight KV handling appears for k >= 1)."""
    cfg = dataclasses.replace(est.config, rollout=dataclasses.replace(est.config.rollout, staleness=staleness))
    in_flight = cfg.rollout.placement == "decoupled" and staleness >= 1
    sync = estimate_weight_sync(cfg, est.rollout, in_flight=in_flight)
    return _compose(cfg, est.train_step, est.rollout, sync, est.reference_s, est.offload_s)


def _compose(cfg: PlanConfig, train_step: TrainStepEstimate, rollout: RolloutEstimate, sync: WeightSyncEstimate,
             reference_s: float, offload_s: float) -> StepTimeEstimate:
    wl = cfg.workload
    return estimate_step_time(
        placement=cfg.rollout.placement, staleness=cfg.rollout.staleness, training_gpus=cfg.training_gpus,
        rollout_gpus=cfg.rollout_gpus, rollout_s=rollout.total_s, reference_s=reference_s,
        train_s=train_step.total_s, weight_sync_s=sync.total_s, weight_send_s=sync.transfer_s, offload_s=offload_s,
        trained_tokens=wl.num_samples * (wl.prompt_len + wl.mean_generated),
        generated_tokens=wl.num_samples * wl.mean_generated,
    )


def estimate_layout(cfg: PlanConfig, *, max_simulated_microbatches: int | None = None,
                    reuse: LayoutEstimate | None = None) -> LayoutEstimate:
    """Evaluate ``cfg``: simulate the training step, size memory, time rollout, sync and the step.

    ``reuse`` takes the training step and memory from an estimate with the same ``train`` section
    (the search varies only the rollout engine on top of it).
    """
    if reuse is not None and reuse.config.train == cfg.train and reuse.config.training_gpus == cfg.training_gpus:
        train_step, memory = reuse.train_step, reuse.memory
    else:
        train_step = estimate_train_step(cfg, max_simulated_microbatches=max_simulated_microbatches)
        memory = estimate_training_memory(cfg)
    rollout = estimate_rollout(cfg, cfg.rollout_gpus, _resident_rollout_bytes(cfg, memory))
    in_flight = cfg.rollout.placement == "decoupled" and cfg.rollout.staleness >= 1
    sync = estimate_weight_sync(cfg, rollout, in_flight=in_flight)
    reference_s = estimate_reference_pass_s(cfg, train_step.durations)
    offload_s = 0.0
    if cfg.rollout.placement == "colocated" and cfg.rollout.offload_optimizer:
        optimizer = max(m.optimizer_bytes for m in memory)
        offload_s = 2 * optimizer / cfg.cluster.host_bandwidth_bytes_per_s  # to host before rollout, back after
    step = _compose(cfg, train_step, rollout, sync, reference_s, offload_s)
    return LayoutEstimate(cfg, train_step, memory, rollout, sync, reference_s, offload_s, step)
