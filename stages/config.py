"""Typed configuration of a grpoflow run.

YAML on disk (configs/*.yaml), frozen dataclasses in code. Each field is documented once, here.
Validation happens in ``__post_init__`` so an impossible setting fails before any work starts,
with a one-line :class:`ConfigError` naming the key and the fix. Parallel settings use the
NeMo / Megatron names (``tensor_model_parallel_size``, ``pipeline_model_parallel_size``, ...).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass, field
from typing import Any, Optional

__all__ = [
    "ConfigError",
    "TaskConfig",
    "ModelConfig",
    "WarmupConfig",
    "RolloutConfig",
    "RewardConfig",
    "AdvantageConfig",
    "TrainConfig",
    "ClusterConfig",
    "MlflowConfig",
    "GRPOConfig",
    "SCHEDULES",
    "LOSS_AGGREGATIONS",
    "config_hash",
    "config_to_dict",
]


class ConfigError(ValueError):
    """A configuration value is wrong; the message names the key and the fix."""


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise ConfigError(message)


def _one_of(key: str, value: str, allowed: tuple[str, ...]) -> None:
    _require(value in allowed, f"{key}={value!r} is not one of {', '.join(allowed)}")


SCHEDULES = ("gpipe", "1f1b")
LOSS_AGGREGATIONS = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm")
ESTIMATORS = ("grpo", "dr_grpo")


@dataclass(frozen=True)
class TaskConfig:
    name: str = "addition"
    """Synthetic task with a verifiable answer (see stages/tasks)."""
    num_digits: int = 2
    """Operands are drawn uniformly from [0, 10**num_digits)."""
    prompts_per_step: int = 16
    """Prompts per iteration; each gets ``rollout.group_size`` completions."""

    def __post_init__(self) -> None:
        _one_of("task.name", self.name, ("addition",))
        _require(1 <= self.num_digits <= 6, f"task.num_digits={self.num_digits} must be in 1..6")
        _require(self.prompts_per_step >= 1, "task.prompts_per_step must be >= 1")


@dataclass(frozen=True)
class ModelConfig:
    path: Optional[str] = None
    """An HF model folder (config.json, *.safetensors, tokenizer.json) to start from. When unset the
    base policy is the task's tiny model, made by a deterministic supervised warm-up and cached."""
    model_type: str = "llama"
    """Architecture family of the built-in tiny model: llama or qwen2."""
    hidden_size: int = 64
    intermediate_size: int = 176
    num_hidden_layers: int = 4
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    tie_word_embeddings: bool = False
    rope_theta: float = 10000.0

    def __post_init__(self) -> None:
        _one_of("model.model_type", self.model_type, ("llama", "qwen2"))
        _require(
            self.num_attention_heads % self.num_key_value_heads == 0,
            f"model.num_attention_heads={self.num_attention_heads} must be a multiple of "
            f"model.num_key_value_heads={self.num_key_value_heads}",
        )
        _require(
            self.hidden_size % self.num_attention_heads == 0,
            f"model.hidden_size={self.hidden_size} must be divisible by "
            f"model.num_attention_heads={self.num_attention_heads}",
        )


@dataclass(frozen=True)
class WarmupConfig:
    steps: int = 1200
    """Supervised steps that make the tiny base policy (kept short so GRPO starts below the ceiling)."""
    batch_size: int = 64
    lr: float = 3e-3


@dataclass(frozen=True)
class RolloutConfig:
    group_size: int = 8
    """G: completions per prompt."""
    max_new_tokens: int = 6
    temperature: float = 1.0
    top_p: float = 1.0
    num_engines: int = 1
    """Generation engines (workers with the ``rollout`` resource); prompts are split between them."""

    def __post_init__(self) -> None:
        _require(self.group_size >= 2, "rollout.group_size must be >= 2 (a group needs a spread)")
        _require(self.max_new_tokens >= 1, "rollout.max_new_tokens must be >= 1")
        _require(self.temperature > 0, "rollout.temperature must be > 0")
        _require(0 < self.top_p <= 1, "rollout.top_p must be in (0, 1]")
        _require(self.num_engines >= 1, "rollout.num_engines must be >= 1")


@dataclass(frozen=True)
class RewardConfig:
    functions: list[str] = field(default_factory=lambda: ["exact_match"])
    """Registered reward functions (stages/reward); a sample's reward is their sum."""
    num_tasks: int = 2
    """Parallel scoring tasks per step; each scores whole groups."""
    timeout_s: float = 5.0
    """Wall-clock limit for one sample's reward; past it the sample scores 0 and is flagged."""


@dataclass(frozen=True)
class AdvantageConfig:
    estimator: str = "grpo"
    """grpo: A = (R - mean) / (std + eps); dr_grpo: A = R - mean (no std scaling)."""
    eps: float = 1e-6

    def __post_init__(self) -> None:
        _one_of("advantage.estimator", self.estimator, ESTIMATORS)


@dataclass(frozen=True)
class TrainConfig:
    pipeline_model_parallel_size: int = 2
    tensor_model_parallel_size: int = 1
    data_parallel_size: int = 1
    micro_batch_size: int = 32
    """Samples per microbatch; a multiple of rollout.group_size keeps groups whole."""
    schedule: str = "1f1b"
    lr: float = 1e-3
    weight_decay: float = 0.0
    max_grad_norm: float = 1.0
    clip_eps_low: float = 0.2
    clip_eps_high: float = 0.2
    kl_beta: float = 0.02
    """Weight of the k3 KL estimate to the reference policy."""
    loss_aggregation: str = "token-mean"
    timeout_s: float = 120.0
    """Limit on every distributed wait (process-group init, send/recv, collectives)."""

    def __post_init__(self) -> None:
        _one_of("train.schedule", self.schedule, SCHEDULES)
        _one_of("train.loss_aggregation", self.loss_aggregation, LOSS_AGGREGATIONS)
        _require(self.pipeline_model_parallel_size >= 1, "train.pipeline_model_parallel_size must be >= 1")
        _require(
            self.tensor_model_parallel_size == 1,
            "train.tensor_model_parallel_size must be 1 in this runtime (tensor parallelism is planned only)",
        )
        _require(
            self.data_parallel_size == 1,
            "train.data_parallel_size must be 1 in this runtime (data parallelism is planned only)",
        )
        _require(self.micro_batch_size >= 1, "train.micro_batch_size must be >= 1")
        _require(self.timeout_s > 0, "train.timeout_s must be > 0")
        _require(0 <= self.clip_eps_low < 1, "train.clip_eps_low must be in [0, 1)")
        _require(self.clip_eps_high >= 0, "train.clip_eps_high must be >= 0")


@dataclass(frozen=True)
class ClusterConfig:
    scheduler_address: Optional[str] = None
    """Connect to this Dask scheduler instead of starting an embedded local cluster."""
    num_plain_workers: int = 1
    """Embedded cluster: workers without resources (reward, advantage, IO)."""
    colocated: bool = False
    """Embedded cluster: give training workers the rollout resource too (one pool for both phases)."""
    iteration_timeout_s: float = 900.0
    """An iteration whose stages have not all finished by then fails, naming the late stages."""


@dataclass(frozen=True)
class MlflowConfig:
    tracking_uri: Optional[str] = None
    """MLflow tracking URI; unset means sqlite in the run folder (runs/<run_name>/mlflow.db)."""
    experiment: str = "grpoflow"


@dataclass(frozen=True)
class GRPOConfig:
    run_name: str = "tiny"
    runs_dir: str = "runs"
    seed: int = 0
    iterations: int = 20
    task: TaskConfig = field(default_factory=TaskConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    warmup: WarmupConfig = field(default_factory=WarmupConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    advantage: AdvantageConfig = field(default_factory=AdvantageConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    mlflow: MlflowConfig = field(default_factory=MlflowConfig)

    def __post_init__(self) -> None:
        _require(self.iterations >= 1, "iterations must be >= 1")
        _require(
            self.run_name and all(c.isalnum() or c in "-_." for c in self.run_name),
            f"run_name={self.run_name!r} may hold only letters, digits, '-', '_' and '.'",
        )
        pp = self.train.pipeline_model_parallel_size
        _require(
            pp <= self.model.num_hidden_layers,
            f"train.pipeline_model_parallel_size={pp} exceeds model.num_hidden_layers="
            f"{self.model.num_hidden_layers}: lower it or add layers",
        )
        num_samples = self.task.prompts_per_step * self.rollout.group_size
        mbs = self.train.micro_batch_size
        _require(
            num_samples % mbs == 0,
            f"train.micro_batch_size={mbs} must divide task.prompts_per_step * rollout.group_size "
            f"= {num_samples}",
        )
        if self.train.schedule == "1f1b":
            _require(
                num_samples // mbs >= pp,
                f"train.schedule=1f1b needs at least pipeline_model_parallel_size={pp} microbatches, "
                f"got {num_samples // mbs}: lower train.micro_batch_size",
            )

    @property
    def num_samples(self) -> int:
        return self.task.prompts_per_step * self.rollout.group_size

    @property
    def num_microbatches(self) -> int:
        return self.num_samples // self.train.micro_batch_size


def config_to_dict(cfg: Any) -> dict[str, Any]:
    return dataclasses.asdict(cfg)


def _plain(obj: Any) -> Any:
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return dataclasses.asdict(obj)
    return str(obj)


def config_hash(cfg: Any) -> str:
    """A short stable digest of a config (or a dict of config parts), recorded beside every stored
    artifact."""
    blob = json.dumps(_plain(cfg) if dataclasses.is_dataclass(cfg) else cfg, sort_keys=True,
                      default=_plain).encode()
    return hashlib.sha256(blob).hexdigest()[:16]
