"""Plan -> plain JSON-able dict (plan.json), and the number formats the report and CLI share."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from planner.constants import GIB
from planner.layout import LayoutEstimate, layout_label
from planner.model import estimate_parameter_count
from planner.plan import Plan
from planner.search import Candidate

__all__ = ["plan_to_dict", "gib", "secs", "pct", "md_table", "candidate_summary"]

_SKIP_FIELDS = {"simulation", "durations", "events", "estimate", "config", "model_shape"}
_MAX_REJECTED_IN_JSON = 200  # near misses first; the counts cover the rest


def gib(num_bytes: float, digits: int = 1) -> str:
    """Bytes as GiB text."""
    return f"{num_bytes / GIB:.{digits}f} GiB"


def secs(seconds: float, digits: int = 1) -> str:
    return "inf" if math.isinf(seconds) else f"{seconds:.{digits}f} s"


def pct(fraction: float, digits: int = 1) -> str:
    return f"{fraction * 100:.{digits}f}%"


def md_table(header: list[str], rows: list[list[Any]]) -> str:
    """A GitHub markdown table."""
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def _plain(value: Any) -> Any:
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _plain(getattr(value, f.name)) for f in dataclasses.fields(value) if f.name not in _SKIP_FIELDS}
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def _layout_dict(est: LayoutEstimate) -> dict[str, Any]:
    sim = est.train_step.simulation
    return {
        "label": layout_label(est.config),
        "fits": est.rejection is None,
        "rejection": est.rejection,
        "memory_per_rank": [dict(_plain(m), total_bytes=m.total_bytes) for m in est.memory],
        "train_step": {
            "pipeline_s": est.train_step.pipeline_s, "dp_sync_s": est.train_step.dp_sync_s,
            "optimizer_s": est.train_step.optimizer_s, "total_s": est.train_step.total_s,
            "num_updates": est.train_step.num_updates, "bubble_fraction": sim.bubble_fraction,
            "bubble_fraction_per_rank": list(sim.bubble_fraction_per_rank),
            "peak_in_flight_per_stage": list(sim.peak_in_flight_per_stage),
            "durations_s": {f"{s}{k}": v for (s, k), v in sorted(est.train_step.durations.per_stage.items())},
            "p2p_s": est.train_step.durations.p2p_s,
        },
        "rollout": _plain(est.rollout),
        "weight_sync": dict(_plain(est.weight_sync), total_s=est.weight_sync.total_s),
        "reference_s": est.reference_s,
        "offload_s": est.offload_s,
        "step": dict(_plain(est.step), tokens_per_s=est.step.tokens_per_s),
    }


def candidate_summary(cand: Candidate) -> dict[str, Any]:
    return {"label": cand.label, "step_s": cand.step_s, "step_s_staleness_0": cand.step_s_sync,
            "step_s_staleness_1": cand.step_s_async,
            "peak_training_bytes": cand.estimate.peak_training_bytes,
            "tokens_per_s": cand.estimate.step.tokens_per_s}


def plan_to_dict(plan: Plan) -> dict[str, Any]:
    """Everything the report shows, as plain JSON types."""
    cfg = plan.config
    out: dict[str, Any] = {
        "config": {name: _plain(getattr(cfg, name)) for name in ("cluster", "train", "workload", "rollout",
                                                                  "search")},
        "model_shape": _plain(cfg.model_shape),
        "parameter_count": estimate_parameter_count(cfg.model_shape),
        "configured": _layout_dict(plan.layout),
        "schedules": [_plain(r) for r in plan.schedules],
        "group_barriers": [_plain(r) for r in plan.group_barriers],
        "microbatches": [_plain(r) for r in plan.microbatches],
        "kv_cache": _plain(plan.kv),
        "rollout_variants": [dict(name=r.name, batching=r.batching, speculative=r.speculative,
                                  mean_gen_len=r.mean_gen_len, rollout=_plain(r.rollout)) for r in plan.rollout_variants],
        "weight_sync_variants": [dict(placement=r.placement, in_flight=r.in_flight, total_s=r.sync.total_s,
                                      **_plain(r.sync)) for r in plan.sync_variants],
        "staleness": [dict(_plain(r.drift), step_s=r.step.step_s if r.step else None,
                           tokens_per_s=r.step.tokens_per_s if r.step else None) for r in plan.staleness],
    }
    for name in ("best_colocated", "best_decoupled_sync", "best_decoupled_async"):
        cand = getattr(plan, name)
        out[name] = None if cand is None else dict(candidate_summary(cand), layout=_layout_dict(cand.estimate))
    if plan.search is not None:
        out["search"] = {
            "evaluated": plan.search.evaluated,
            "feasible": len(plan.search.feasible),
            "rejection_counts": plan.search.rejection_counts,
            "top": [candidate_summary(c) for c in plan.search.top(cfg.search.top_k)],
            "rejected": [_plain(r) for r in plan.search.rejected[:_MAX_REJECTED_IN_JSON]],
        }
    return out
