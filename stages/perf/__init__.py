"""Step performance metrics: the model FLOPs of a GRPO step's phases (torch-free, from the
planner's per-token formula) and the MFU they make against a measured matmul rate.

The rate itself is measured by :mod:`stages.perf.matmul_rate` (torch; import it by its path) and
cached per host by :mod:`storage.host_rates`.
"""

from stages.perf.flops import (
    STEP_PHASES,
    forward_flops,
    mfu,
    reference_flops,
    rollout_flops,
    score_flops,
    step_mfu_metrics,
    step_model_flops,
    train_flops,
)

__all__ = ["STEP_PHASES", "forward_flops", "score_flops", "reference_flops", "train_flops", "rollout_flops",
           "step_model_flops", "step_mfu_metrics", "mfu"]
