"""grpoflow planner: analytic memory / KV / bubble / throughput model, schedule simulator, layout search.

Pure arithmetic with sources; no torch. Of the runtime it imports only the shared, torch-free facts
(stages.layout: shape, layer split, schedules, placement, TP rules; stages.config: the run schema it
plans; stages.train.plan: the microbatch count). The entry points the runtime's validation tests call
are re-exported here.
"""

from planner.calibrate import estimate_durations_from_timeline
from planner.config import PlanConfig, PlanConfigError
from planner.loader import load_plan_config, plan_config_from_dict
from planner.memory import (
    TORCH_EAGER_IMPL,
    ActivationImpl,
    estimate_activation_breakdown,
    estimate_activation_bytes_per_microbatch,
    estimate_kv_cache_bytes,
)
from planner.model import (
    ModelShape,
    estimate_kv_bytes_per_token,
    estimate_parameter_count,
    model_from_hf_config,
    model_from_preset,
)
from planner.schedules import build_pipeline_order
from planner.simulator import ActionDurations, ScheduleSimulation, simulate_schedule

__all__ = [
    "ActionDurations",
    "ActivationImpl",
    "ModelShape",
    "PlanConfig",
    "PlanConfigError",
    "ScheduleSimulation",
    "TORCH_EAGER_IMPL",
    "build_pipeline_order",
    "estimate_activation_breakdown",
    "estimate_activation_bytes_per_microbatch",
    "estimate_durations_from_timeline",
    "estimate_kv_bytes_per_token",
    "estimate_kv_cache_bytes",
    "estimate_parameter_count",
    "load_plan_config",
    "model_from_hf_config",
    "model_from_preset",
    "plan_config_from_dict",
    "simulate_schedule",
]
