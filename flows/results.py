"""What each task of a step returns: one frozen dataclass per kind of task result.

A task's result travels to the tasks after it and to the driver (flows/iteration.py folds them into
the step's metrics), and it is stored with its stage's completion mark as a plain JSON dict
(``results_<stage>`` in the step group's attrs), so a resumed step whose stage is skipped still
reports what the stage measured. ``to_dict`` writes that dict, flat, leaving out what was not
measured; ``from_dict`` reads it back, ignoring keys it does not know (a step stored by an older
version). Built from keyword arguments, a result refuses a key it does not know: a new measurement
gets a field here before a task can return it.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any, Mapping, Self

import numpy as np

__all__ = ["TaskResult", "RolloutResult", "ScoreResult", "AdvantageResult", "ReferenceResult", "ProximalResult",
           "TrainResult", "TaskSpan", "result_of_stage", "jsonable"]


def jsonable(value):
    """Plain JSON types (numpy scalars -> float / int, tuples -> lists); floats round-trip exactly."""
    if isinstance(value, dict):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [jsonable(v) for v in value]
    if isinstance(value, (bool, np.bool_)):
        return bool(value)
    if isinstance(value, (int, np.integer)):
        return int(value)
    if isinstance(value, (float, np.floating)):
        return float(value)
    return str(value)


@dataclass(frozen=True, kw_only=True, slots=True)
class TaskResult:
    """A task's measurements. ``_unstored``: fields that stay out of the stored dict."""

    _unstored = ()

    def to_dict(self) -> dict[str, Any]:
        """The stored form: plain JSON types, without fields left at None or unstored."""
        return {f.name: jsonable(v) for f in fields(self)
                if f.name not in self._unstored and (v := getattr(self, f.name)) is not None}

    @classmethod
    def from_dict(cls, stored: Mapping[str, Any]) -> Self:
        """The result a stage's mark stored (:meth:`to_dict`)."""
        return cls(**{f.name: stored[f.name] for f in fields(cls) if f.name in stored})


@dataclass(frozen=True, kw_only=True, slots=True)
class TaskSpan(TaskResult):
    """When a task ran (time.time): the stored result of a task whose return value is not a
    measurement (publish's PolicyRef)."""

    task_start: float
    task_end: float


@dataclass(frozen=True, kw_only=True, slots=True)
class RolloutResult(TaskResult):
    """A rollout task: its range's generation, the engine's weight load, and (reward.in_rollout) the
    scoring of its groups."""

    rollout_tokens: float
    rollout_seconds: float  # generate() alone
    rollout_tokens_per_s: float
    kv_cache_bytes: float
    weights_from: str  # held, memory or disk
    weight_load_seconds: float
    task_start: float
    task_end: float
    # Where the weights came from (cluster.weight_sync): a disk load, or the copy received in memory.
    weight_load_disk_seconds: float | None = None
    weights_not_in_memory: str | None = None
    weight_sync_memory_load_seconds: float | None = None
    weight_sync_memory_receive_seconds: float | None = None
    weight_sync_memory_receive_bytes: int | None = None
    weights_content_hash: str | None = None
    # The engine's own: rollout.draft_* (speculative decoding); rollout.engine=vllm (server starts).
    speculative_acceptance: float | None = None
    speculative_tokens_per_forward: float | None = None
    engine_starts: int | None = None
    engine_start_seconds: float | None = None
    # rollout.dynamic_sampling: the range's groups over every round.
    groups_generated: float | None = None
    groups_dropped: float | None = None
    groups_unfilled: float | None = None
    sampling_rounds: float | None = None
    generated_samples: float | None = None
    # reward.in_rollout: the task scored its own groups.
    reward_seconds: float | None = None
    reward_failed: float | None = None
    reward_first_error: str | None = None
    reward_functions: dict[str, dict] | None = None

    def scores(self) -> ScoreResult:
        """The scoring of its groups as the reward stage reports it (reward.in_rollout)."""
        return ScoreResult(statistics={"reward_failed": self.reward_failed},
                           reward_first_error=self.reward_first_error or "",
                           reward_functions=self.reward_functions or {})


@dataclass(frozen=True, kw_only=True, slots=True)
class AdvantageResult(TaskResult):
    """The reward statistics of the step (stages/reward/rows.py reward_statistics), which become
    step metrics as they are."""

    statistics: dict[str, float]

    def to_dict(self) -> dict[str, Any]:
        return jsonable(self.statistics)

    @classmethod
    def from_dict(cls, stored: Mapping[str, Any]) -> Self:
        return cls(statistics={k: v for k, v in stored.items() if k not in _SCORE_FIELDS})


_SCORE_FIELDS = ("reward_first_error", "reward_functions")


@dataclass(frozen=True, kw_only=True, slots=True)
class ScoreResult(AdvantageResult):
    """A scoring task: the reward statistics of its range of groups, why its first failed sample
    failed ("" if none did), and each reward function's sums (ScoredGroups.function_metrics)."""

    reward_first_error: str = ""
    reward_functions: dict[str, dict] = field(default_factory=dict)

    @property
    def reward_failed(self) -> float:
        return self.statistics["reward_failed"]

    def to_dict(self) -> dict[str, Any]:
        return jsonable({**self.statistics, "reward_first_error": self.reward_first_error,
                         "reward_functions": self.reward_functions})

    @classmethod
    def from_dict(cls, stored: Mapping[str, Any]) -> Self:
        return cls(statistics={k: v for k, v in stored.items() if k not in _SCORE_FIELDS},
                   reward_first_error=stored.get("reward_first_error", ""),
                   reward_functions=stored.get("reward_functions", {}))


@dataclass(frozen=True, kw_only=True, slots=True)
class ReferenceResult(TaskResult):
    """A rank's share of the reference pass. ``rank`` -1: stored before results named the rank."""

    reference_seconds: float
    task_start: float
    task_end: float
    rank: int = -1


@dataclass(frozen=True, kw_only=True, slots=True)
class ProximalResult(TaskResult):
    """A rank's share of the proximal pass (train.off_policy.proximal = pass)."""

    proximal_seconds: float
    task_start: float
    task_end: float
    rank: int = -1


@dataclass(frozen=True, kw_only=True, slots=True)
class TrainResult(TaskResult):
    """A training rank's step: the pipeline's metrics, its timeline, the shard it wrote, the
    in-memory send (cluster.weight_sync=memory) and, with train.reference_pass = fused, the
    reference pass it ran first. Its Chrome ``events`` and the fused pass's own result
    (``reference``, stored as the reference stage's) stay out of the stored dict."""

    _unstored = ("events", "reference")

    rank: int
    metrics: dict[str, float]
    window_ns: tuple[int, int]  # the step's (start, end) on the rank's clock
    shard_bytes: int
    shard_seconds: float
    task_start: float
    task_end: float
    events: list[dict] = field(default_factory=list)
    weight_sync_memory_send_seconds: float | None = None
    weight_sync_memory_send_bytes: int | None = None
    weight_sync_memory_send_hash_seconds: float | None = None
    weight_sync_memory_send_failed: int | None = None
    reference_seconds: float | None = None  # train.reference_pass = fused: the pass inside this task
    reference: ReferenceResult | None = None  # ... on the output rank, the pass's result as its stage stores it
    tied_sha256: str | None = None  # the tied embedding's digest on ranks holding a copy of it


_BY_STAGE: dict[str, type[TaskResult]] = {
    "rollout": RolloutResult, "reward": ScoreResult, "advantage": AdvantageResult, "reference": ReferenceResult,
    "proximal": ProximalResult, "train": TrainResult, "publish": TaskSpan}


def result_of_stage(stage: str, stored: Mapping[str, Any]) -> TaskResult:
    """The result ``stored`` with ``stage``'s mark (:meth:`TaskResult.to_dict`)."""
    return _BY_STAGE[stage].from_dict(stored)
