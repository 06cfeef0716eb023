"""Torch-free facts about a model and its parallel layout, shared by the runtime and the planner:
the model shape and its HF config.json parsing, the layer split, pipeline schedules (names, torch's
constraints, stage placement), the (pp, dp, tp) mesh and the tensor-parallel rules."""

from stages.layout.mesh import MeshCoord, ParallelLayout
from stages.layout.pipeline import (
    SCHEDULES,
    SPLIT_BACKWARD,
    V_SHAPED,
    ScheduleName,
    balanced_layer_split,
    layer_ranges,
    layer_split_error,
    layers_per_stage,
    schedule_error,
    stage_to_rank,
)
from stages.layout.shape import MODEL_TYPES, ModelShape, attention_bias_of, hf_rope_theta, shape_from_hf
from stages.layout.tensor_parallel import (
    MEGATRON_TP,
    RUNTIME_TP,
    TP_RULES,
    TensorParallelRules,
    kv_heads_per_rank,
    parallel_layout_error,
    tensor_parallel_error,
)

__all__ = [
    "MeshCoord", "ParallelLayout",
    "ScheduleName", "SCHEDULES", "V_SHAPED", "SPLIT_BACKWARD", "schedule_error", "stage_to_rank", "layer_ranges",
    "layers_per_stage", "balanced_layer_split", "layer_split_error",
    "MODEL_TYPES", "ModelShape", "attention_bias_of", "shape_from_hf", "hf_rope_theta",
    "TensorParallelRules", "RUNTIME_TP", "MEGATRON_TP", "TP_RULES", "tensor_parallel_error", "kv_heads_per_rank",
    "parallel_layout_error",
]
