"""Cross-section checks of a plan config: combinations that cannot run, phrased with the key and the fix.

Kept apart from :mod:`planner.config` (which calls it from ``PlanConfig.__post_init__``); it reads the
config's attributes only, so it imports nothing from there at run time.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from planner.schedules import schedule_constraint_error

if TYPE_CHECKING:
    from planner.config import PlanConfig

__all__ = ["plan_layout_error"]


def plan_layout_error(cfg: PlanConfig) -> str | None:
    """First reason the combination of sections is impossible, naming the key and fix; None if fine."""
    return _placement_error(cfg) or _parallel_error(cfg) or _batch_error(cfg)


def _placement_error(cfg: PlanConfig) -> str | None:
    ro, cl = cfg.rollout, cfg.cluster
    if ro.placement == "colocated" and ro.rollout_gpus not in (None, cl.num_gpus):
        return "rollout.rollout_gpus: applies to placement=decoupled only; remove it or set placement=decoupled"
    if ro.placement == "decoupled":
        if ro.rollout_gpus is None or not 0 < ro.rollout_gpus < cl.num_gpus:
            return (f"rollout.rollout_gpus: decoupled placement needs 0 < rollout_gpus < cluster.num_gpus "
                    f"({cl.num_gpus}), got {ro.rollout_gpus}")
    if cfg.rollout_gpus % ro.rollout_tensor_parallel_size:
        return (f"rollout.rollout_tensor_parallel_size: {ro.rollout_tensor_parallel_size} must divide the rollout "
                f"GPUs ({cfg.rollout_gpus})")
    if cfg.model_shape.num_attention_heads % ro.rollout_tensor_parallel_size:
        return (f"rollout.rollout_tensor_parallel_size: {ro.rollout_tensor_parallel_size} must divide "
                f"num_attention_heads ({cfg.model_shape.num_attention_heads})")
    return None


def _parallel_error(cfg: PlanConfig) -> str | None:
    tr, shape = cfg.train, cfg.model_shape
    tp, pp, dp, v = (tr.tensor_model_parallel_size, tr.pipeline_model_parallel_size, tr.data_parallel_size,
                     tr.virtual_pipeline_model_parallel_size)
    if tp * pp * dp != cfg.training_gpus:
        fix = (f"set train.data_parallel_size={cfg.training_gpus // (tp * pp)}" if cfg.training_gpus % (tp * pp) == 0
               else "choose TP and PP whose product divides the training GPUs")
        return (f"train: TP*PP*DP = {tp}*{pp}*{dp} = {tp * pp * dp} must equal the training GPUs "
                f"({cfg.training_gpus}); {fix}")
    if tp > cfg.cluster.gpus_per_node:
        return (f"train.tensor_model_parallel_size: {tp} exceeds cluster.gpus_per_node ({cfg.cluster.gpus_per_node}); "
                "TP all-reduces must stay on NVLink, use a smaller TP and a larger PP")
    if shape.num_attention_heads % tp:
        return f"train.tensor_model_parallel_size: {tp} must divide num_attention_heads ({shape.num_attention_heads})"
    if shape.num_key_value_heads % tp and tp % shape.num_key_value_heads:
        return (f"train.tensor_model_parallel_size: {tp} and num_key_value_heads ({shape.num_key_value_heads}) "
                "must divide one another")
    if pp * v > shape.num_layers:
        return (f"train.pipeline_model_parallel_size: PP*v = {pp}*{v} = {pp * v} stages exceed the "
                f"{shape.num_layers} layers; lower PP or virtual_pipeline_model_parallel_size")
    return None


def _batch_error(cfg: PlanConfig) -> str | None:
    tr, wl = cfg.train, cfg.workload
    gbs, per_replica = cfg.global_batch_size, tr.data_parallel_size * tr.micro_batch_size
    if wl.num_samples % gbs or gbs % wl.group_size:
        return (f"train.global_batch_size: {gbs} must divide the {wl.num_samples} samples of a step and be a "
                f"multiple of group_size ({wl.group_size})")
    if gbs % tr.data_parallel_size:
        return (f"train.data_parallel_size: {tr.data_parallel_size} must divide the global batch ({gbs} samples); "
                "choose a DP that divides it, or change train.global_batch_size")
    if gbs % per_replica:
        return (f"train.micro_batch_size: global batch {gbs} must split evenly into DP*micro_batch_size = "
                f"{per_replica}; choose micro_batch_size dividing {gbs // tr.data_parallel_size}")
    error = schedule_constraint_error(tr.schedule, tr.pipeline_model_parallel_size, cfg.num_microbatches,
                                      tr.virtual_pipeline_model_parallel_size)
    return f"train.schedule: {error}" if error else None
