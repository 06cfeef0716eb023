"""Read a run config (the runtime's schema, flows/config.py) and its ``plan:`` section into a PlanConfig.

The run's own validation runs first, so a config the run rejects is rejected here with the same
message; then the planner's sections are built from what the run would do:

- model: ``model.path``'s config.json, else the built-in model of the ``model`` section (vocabulary:
  ``model.vocab_size`` or the task tokenizer's);
- workload: ``task.prompts_per_step``, ``rollout.group_size``, prompt length = the task's prompt width
  (or ``plan.workload.prompt_len``), generation length = ``rollout.max_new_tokens``;
- layout: ``train.*`` (TP, PP, DP, v, micro-batch, schedule, clip range);
- everything else from ``plan.*`` (planner/config.py documents each field).
"""

from __future__ import annotations

import dataclasses
import json
import types
import typing
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

from flows.config import ConfigError, GRPOConfig, resolve_reference_parallel
from planner.config import (
    ClusterConfig,
    PlanConfig,
    PlanConfigError,
    RolloutConfig,
    SearchConfig,
    TrainConfig,
    WorkloadConfig,
)
from planner.model import ModelShape, model_from_hf_config
from storage.model_folder import ModelFolderError

__all__ = ["plan_config_from_run", "plan_config_from_dict", "load_plan_config"]

# train.* keys the planner takes from the run; plan.train holds only the planner's own knobs
_RUN_TRAIN_KEYS = ("tensor_model_parallel_size", "pipeline_model_parallel_size", "data_parallel_size",
                   "virtual_pipeline_model_parallel_size", "micro_batch_size", "schedule", "clip_eps_low",
                   "clip_eps_high", "reference_parallel", "layer_split")
_PLAN_TOP_KEYS = ("activation_impl", "tp_rules")
_PLAN_WORKLOAD_KEYS = ("prompt_len", "mean_gen_len")
_PLAN_SECTIONS = {"cluster": ClusterConfig, "rollout": RolloutConfig, "search": SearchConfig}


def load_plan_config(path: str | Path, overrides: list[str] | tuple[str, ...] = ()) -> PlanConfig:
    """Read the run YAML at ``path``, apply ``key=value`` dotlist overrides (``plan.cluster.num_gpus=32``)."""
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    path = Path(path)
    if not path.is_file():
        raise PlanConfigError(f"config: no file at {path}; pass the path of a run YAML (e.g. configs/tiny.yaml)")
    for item in overrides:
        if "=" not in item or item.startswith("="):
            raise PlanConfigError(f"override {item!r}: write overrides as section.key=value, e.g. train.schedule=zbv")
    try:
        data = OmegaConf.merge(OmegaConf.load(path), OmegaConf.from_dotlist(list(overrides)))
    except (OmegaConfBaseException, ValueError) as exc:
        raise PlanConfigError(f"config {path}: cannot parse ({str(exc).splitlines()[0]})") from exc
    return plan_config_from_dict(OmegaConf.to_container(data, resolve=True), base_dir=path.parent)


def plan_config_from_dict(data: Mapping[str, Any], *, base_dir: str | Path = ".") -> PlanConfig:
    """Validate a nested dict in the run's schema (parsed YAML) as the run does, then plan it."""
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    if not isinstance(data, Mapping):
        raise PlanConfigError("config: top level must be a mapping of sections")
    data = _model_path_from(data, Path(base_dir))
    try:
        run = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(GRPOConfig), OmegaConf.create(dict(data))))
    except (ConfigError, ModelFolderError) as exc:
        raise PlanConfigError(str(exc)) from None
    except OmegaConfBaseException as exc:
        key = getattr(exc, "full_key", None)
        raise PlanConfigError(f"{key + ': ' if key else ''}{str(exc).strip().splitlines()[0]}") from None
    assert isinstance(run, GRPOConfig)
    return plan_config_from_run(run, base_dir=base_dir)


def _model_path_from(data: Mapping[str, Any], base_dir: Path) -> Mapping[str, Any]:
    """``data`` with a relative model.path that names a folder beside the config file made absolute:
    a plan reads the config from wherever it lies, the run from its working directory."""
    model = data.get("model")
    path = model.get("path") if isinstance(model, Mapping) else None
    if not path or Path(path).is_absolute() or Path(path).exists() or not (base_dir / path).exists():
        return data
    return {**data, "model": {**model, "path": str((base_dir / path).resolve())}}


def plan_config_from_run(run: GRPOConfig, *, base_dir: str | Path = ".") -> PlanConfig:
    """The plan of ``run``: its model, workload and layout, with the knobs of ``run.plan``."""
    plan = dict(run.plan or {})
    known = (*_PLAN_TOP_KEYS, "train", "workload", *_PLAN_SECTIONS)
    for key in plan:
        if key not in known:
            raise PlanConfigError(f"plan.{key}: unknown key; known keys of plan: {', '.join(known)}")
    # Unset, the cluster is the run's own training ranks (colocated rollout on them); on a CPU run,
    # those ranks on this host at its measured rates.
    defaults: dict[str, dict[str, Any]] = {"cluster": {"num_gpus": run.train.world_size}}
    if "cluster" not in plan and _trains_on_cpu(run):
        from planner.host import host_cluster

        defaults["cluster"] = host_cluster(run.train.world_size, run.train.dtype, run.runs_dir)
    sections = {name: _build_section(cls, f"plan.{name}", {**defaults.get(name, {}), **_mapping(plan, name)})
                for name, cls in _PLAN_SECTIONS.items()}
    train_knobs = _mapping(plan, "train")
    for key in train_knobs:
        if key in _RUN_TRAIN_KEYS:
            raise PlanConfigError(f"plan.train.{key}: the run's own setting; set train.{key} instead")
    t = run.train
    shape = _model_shape(run, Path(base_dir))
    train_values = {**{k: getattr(t, k) for k in _RUN_TRAIN_KEYS},
                    "reference_parallel": resolve_reference_parallel(t, shape),
                    "layer_split": None if t.layer_split == "auto" else tuple(t.layer_split),
                    "chunked_new_tokens": None if run.logprob_chunk_tokens is None else run.rollout.max_new_tokens,
                    **train_knobs,
                    **{k: plan[k] for k in _PLAN_TOP_KEYS if k in plan}}
    train = _build_section(TrainConfig, "plan.train", train_values)
    workload_knobs = _mapping(plan, "workload")
    for key in workload_knobs:
        if key not in _PLAN_WORKLOAD_KEYS:
            raise PlanConfigError(f"plan.workload.{key}: unknown key; the run sets the rest (task.prompts_per_step, "
                                  f"rollout.group_size, rollout.max_new_tokens); known: {', '.join(_PLAN_WORKLOAD_KEYS)}")
    workload = _build_section(WorkloadConfig, "plan.workload", {
        "prompts_per_step": run.task.prompts_per_step, "group_size": run.rollout.group_size,
        "prompt_len": run.prompt_width, "gen_len": run.rollout.max_new_tokens, **workload_knobs})
    return PlanConfig(model_shape=shape, train=train, workload=workload, **sections)


def _trains_on_cpu(run: GRPOConfig) -> bool:
    if run.train.device != "auto":
        return run.train.device == "cpu"
    import torch

    return not (torch.cuda.is_available() and torch.cuda.device_count() >= run.train.world_size)


def _mapping(plan: Mapping[str, Any], name: str) -> Mapping[str, Any]:
    raw = plan.get(name) or {}
    if not isinstance(raw, Mapping):
        raise PlanConfigError(f"plan.{name}: expected a mapping of keys, got {type(raw).__name__}")
    return raw


def _model_shape(run: GRPOConfig, base_dir: Path) -> ModelShape:
    m = run.model
    if not m.path:
        shape = m.shape(_task_vocab_size())
        fields = {f.name: getattr(shape, f.name) for f in dataclasses.fields(shape)}
        return ModelShape(**fields, name=run.run_name)
    path = Path(m.path)
    if not path.is_absolute() and not path.exists():
        path = base_dir / path
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        raise PlanConfigError(f"model.path: no config.json at {m.path}; give an HF model folder")
    try:
        return model_from_hf_config(json.loads(path.read_text()), name=path.parent.name or path.stem)
    except (ValueError, json.JSONDecodeError) as exc:
        raise PlanConfigError(f"model.path: {path}: {exc}") from None


def _task_vocab_size() -> int:
    """Vocabulary of the task tokenizer the built-in model is made with (stages/tasks/addition.py)."""
    from stages.tasks.addition import make_tokenizer_json

    return len(json.loads(make_tokenizer_json())["model"]["vocab"])


def _build_section(cls: type, name: str, raw: Mapping[str, Any]) -> Any:
    hints = typing.get_type_hints(cls)
    known = [f.name for f in dataclasses.fields(cls)]
    values = {}
    for key, value in raw.items():
        if key not in known:
            raise PlanConfigError(f"{name}.{key}: unknown key; known keys of {name}: {', '.join(known)}")
        values[key] = _coerce(value, hints[key], f"{name}.{key}")
    return cls(**values)


def _coerce(value: Any, hint: Any, key: str) -> Any:
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is Literal:
        if value not in args:
            raise PlanConfigError(f"{key}: {value!r} is not one of {', '.join(map(str, args))}")
        return value
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        options = [a for a in args if a is not type(None)]
        return _coerce(value, options[0], key)
    if hint is bool and not isinstance(value, bool):
        raise PlanConfigError(f"{key}: expected true or false, got {value!r}")
    if hint is int and (isinstance(value, bool) or not isinstance(value, int)):
        if isinstance(value, float) and value.is_integer():
            return int(value)
        raise PlanConfigError(f"{key}: expected an integer, got {value!r}")
    if hint is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise PlanConfigError(f"{key}: expected a number, got {value!r}")
        return float(value)
    if hint is str and not isinstance(value, str):
        raise PlanConfigError(f"{key}: expected a string, got {value!r}")
    return value
