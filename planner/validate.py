"""Cross-section checks of a plan config: combinations that cannot run, phrased with the key and the fix.

Kept apart from :mod:`planner.config` (which calls it from ``PlanConfig.__post_init__``); it reads the
config's attributes only, so it imports nothing from there at run time.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from stages.layout import layer_split_error, parallel_layout_error

if TYPE_CHECKING:
    from planner.config import PlanConfig

__all__ = ["plan_layout_error"]


def plan_layout_error(cfg: PlanConfig) -> str | None:
    """First reason the combination of sections is impossible, naming the key and fix; None if fine."""
    return _placement_error(cfg) or _batch_error(cfg) or _parallel_error(cfg)


def _placement_error(cfg: PlanConfig) -> str | None:
    ro, cl = cfg.rollout, cfg.cluster
    if ro.placement == "colocated" and ro.rollout_gpus not in (None, cl.num_gpus):
        return "plan.rollout.rollout_gpus: applies to placement=decoupled only; remove it or set placement=decoupled"
    if ro.placement == "decoupled":
        if ro.rollout_gpus is None or not 0 < ro.rollout_gpus < cl.num_gpus:
            return (f"plan.rollout.rollout_gpus: decoupled placement needs 0 < rollout_gpus < cluster.num_gpus "
                    f"({cl.num_gpus}), got {ro.rollout_gpus}")
    if cfg.rollout_gpus % ro.rollout_tensor_parallel_size:
        return (f"plan.rollout.rollout_tensor_parallel_size: {ro.rollout_tensor_parallel_size} must divide the rollout "
                f"GPUs ({cfg.rollout_gpus})")
    if cfg.model_shape.num_attention_heads % ro.rollout_tensor_parallel_size:
        return (f"plan.rollout.rollout_tensor_parallel_size: {ro.rollout_tensor_parallel_size} must divide "
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
                f"({cfg.training_gpus} of plan.cluster.num_gpus); {fix}")
    if tp > cfg.cluster.gpus_per_node:
        return (f"train.tensor_model_parallel_size: {tp} exceeds plan.cluster.gpus_per_node ({cfg.cluster.gpus_per_node}); "
                "TP all-reduces must stay on NVLink, use a smaller TP and a larger PP")
    # The run config asks the same question (stages/config.py), so the planner accepts exactly what the runtime does.
    error = parallel_layout_error(shape, tp=tp, pp=pp, virtual=v, schedule=tr.schedule,
                                  num_microbatches=cfg.num_microbatches, rules=tr.tensor_parallel_rules)
    if error is None and tr.layer_split is not None and len(tr.layer_split) == pp * v:  # others: auto
        error = layer_split_error(tr.layer_split, shape.num_hidden_layers, pp * v)
    return error


def _batch_error(cfg: PlanConfig) -> str | None:
    tr, wl = cfg.train, cfg.workload
    if wl.prompts_per_step % tr.data_parallel_size:
        return (f"train.data_parallel_size={tr.data_parallel_size} must divide task.prompts_per_step="
                f"{wl.prompts_per_step} (each data-parallel rank takes whole groups)")
    return None
