"""Re-export of the training layout, which lives in :mod:`stages.layout` (shared with the planner)."""

from stages.layout import SCHEDULES, SPLIT_BACKWARD, V_SHAPED, MeshCoord, ParallelLayout, schedule_error

__all__ = ["SCHEDULES", "V_SHAPED", "SPLIT_BACKWARD", "MeshCoord", "ParallelLayout", "schedule_error"]
