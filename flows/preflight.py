"""Checks a run makes before any work starts: each bad input is refused with one line naming the
key, file or sample, and nothing stored is changed.

- ``model.path``: an HF folder with config.json of a supported model_type, tokenizer.json and
  safetensors holding every tensor the model needs at its configured shape;
- an existing run folder: started with the same config, except :data:`SAFE_TO_CHANGE` keys
  (run.json); its Zarr steps readable, their arrays hashing to the digests their stages recorded; its
  policy versions' files (weights, optimiser state, config, tokenizer) hashing to their manifests;
- prompts no wider than the step layout's prompt width under model.path's tokenizer (:func:`check_task_prompts`);
- ``rollout.device`` and ``train.device``: devices this machine has (:func:`check_devices`).

NaN or infinite rewards are not refused here: the reward stage marks those samples failed
(stages/reward ``score_samples``), and failed samples carry no gradient.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import numpy as np

from flows.config import ConfigError, GRPOConfig, config_to_dict
from storage.model_folder import ModelFolderError, iter_tensors, load_hf_config, tensor_shapes, tokenizer_file_names

__all__ = ["SAFE_TO_CHANGE", "PreflightError", "config_differences", "check_model_folder", "check_draft_folder",
           "check_devices", "check_eval_data", "check_run_config", "check_run_folder", "check_task_prompts",
           "preflight", "warn_pretrained_lr"]

SAFE_TO_CHANGE = ("iterations", "run_name", "runs_dir", "cluster.", "mlflow.", "plan.", "eval.",
                  "train.keep_optimizer_state", "train.keep_versions", "train.keep_every")
"""Config keys (or key prefixes, ending in '.') a resumed run may change: they decide how long and
where the run goes and what it keeps on disk, not what it computes. docs/reliability.md lists them."""

log = logging.getLogger(__name__)


class PreflightError(ConfigError):
    """A bad input found before work starts; one line naming the key, file or sample."""


def _flatten(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        if isinstance(v, dict) and v:
            out.update(_flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def _safe(key: str) -> bool:
    return any(key == s or (s.endswith(".") and key.startswith(s)) for s in SAFE_TO_CHANGE)


def config_differences(stored: dict[str, Any], current: dict[str, Any]) -> list[str]:
    """Dotted keys whose values differ between two config dicts, safe-to-change keys left out."""
    a, b = _flatten(stored), _flatten(json.loads(json.dumps(current)))  # tuples -> lists, as stored
    return sorted(k for k in set(a) | set(b) if not _safe(k) and a.get(k, "<unset>") != b.get(k, "<unset>"))


def _model_error(path: Path, what: str) -> PreflightError:
    return PreflightError(f"model.path={path}: {what}")


def check_model_folder(path: str | Path) -> None:
    """An HF folder the run can load: config.json (supported model_type), tokenizer.json and every
    tensor at the shape config.json implies (the safetensors headers), with finite values (every
    weight read once: ~1 s for SmolLM2-135M's 538 MB)."""
    from stages.policy import DecoderConfig, build_stage, hf_named_parameters

    path = Path(path)
    try:
        hf = load_hf_config(path)
    except ModelFolderError as exc:
        raise PreflightError(str(exc)) from None
    try:
        model_cfg = DecoderConfig.from_hf(hf)
    except Exception as exc:  # unsupported model_type, missing or inconsistent sizes
        raise _model_error(path, f"config.json: {str(exc).strip().splitlines()[0] or type(exc).__name__}") from None
    if not tokenizer_file_names(path, ("tokenizer.json",)):
        raise _model_error(path, "no tokenizer.json (save the tokenizer with save_pretrained into the folder)")
    try:
        shapes = tensor_shapes(path)
    except ModelFolderError as exc:
        raise PreflightError(str(exc)) from None
    import torch

    with torch.device("meta"):
        expected = {n: tuple(p.shape) for n, p in hf_named_parameters(build_stage(model_cfg))}
    for name, shape in sorted(expected.items()):
        if name not in shapes:
            raise _model_error(path, f"tensor {name} is missing from the safetensors files")
        if shapes[name] != shape:
            raise _model_error(path, f"tensor {name} has shape {list(shapes[name])}, config.json implies {list(shape)}")
    # A NaN or inf weight would train on NaN losses; each tensor is read once (memory-mapped).
    for file, name, tensor in iter_tensors(path, set(expected)):
        if not bool(torch.isfinite(tensor).all()):
            raise _model_error(path, f"tensor {name} in {file} holds NaN or infinite values")


def _lr_resolved(config: dict[str, Any], cfg: GRPOConfig) -> dict[str, Any]:
    """``config`` with train.lr=auto as the rate it picks for ``cfg`` (their model.path is compared
    on its own): a run stored with the number auto resolves to resumes under auto, and back."""
    train = config.get("train")
    if not isinstance(train, dict) or train.get("lr") != "auto":
        return config
    return {**config, "train": {**train, "lr": cfg.lr}}


def _check_config(cfg: GRPOConfig, state: dict[str, Any], folder) -> None:
    stored = state.get("config")
    if not isinstance(stored, dict):
        raise PreflightError(f"{folder.run_state} holds no config; delete it or start with --new")
    diff = config_differences(_lr_resolved(stored, cfg), _lr_resolved(config_to_dict(cfg), cfg))
    t, before = cfg.train, stored.get("iterations")
    if before != cfg.iterations and t.lr_schedule != "constant" and t.lr_decay_steps is None and \
            isinstance(before, int):
        raise PreflightError(f"iterations={cfg.iterations} differs from the run's {before}, and train.lr_schedule="
                             f"{t.lr_schedule} with train.lr_decay_steps unset decays over iterations, so the "
                             "remaining steps' rates would change; run with --new (set train.lr_decay_steps in a "
                             "run whose length may change)")
    if diff:
        shown = ", ".join(diff[:8]) + (f" (+{len(diff) - 8} more)" if len(diff) > 8 else "")
        raise PreflightError(f"run folder {folder.root} was started with a different config: {shown} differ; "
                             "run with --new (or another run_name) to start over")


def _check_steps(cfg: GRPOConfig, folder) -> None:
    from flows.iteration import step_layout

    store = folder.rollout_store()
    expected = step_layout(cfg)
    for step in store.steps():
        where = f"rollout step {step} ({store.ref(step).path})"
        if not store.has_step(step):
            continue  # a folder without group metadata: killed while (re)creating it; a rerun recreates it
        try:
            attrs = store.attrs(step)
            layout = store.layout(step)
        except Exception as exc:
            raise PreflightError(f"{where}: unreadable attributes: {str(exc).splitlines()[0]}") from None
        if (layout.num_prompts, layout.group_size, layout.prompt_width, layout.max_new_tokens) != (
                expected.num_prompts, expected.group_size, expected.prompt_width, expected.max_new_tokens):
            raise PreflightError(f"{where}: stored with another layout than the config's; start with --new")
        if not attrs.get("complete"):
            continue  # nothing of it is reused: a rerun regenerates it whole
        try:
            from storage.rollouts import ARRAYS

            for name in ARRAYS:
                values = store.read(step, name)[name]
                if len(values) != expected.num_samples:
                    raise ValueError(f"array {name} holds {len(values)} rows, not {expected.num_samples}")
                if values.dtype.kind == "f" and not np.isfinite(values).all():
                    raise ValueError(f"array {name} holds NaN or infinite values")
        except Exception as exc:
            raise PreflightError(f"{where} is corrupt or truncated: {str(exc).strip().splitlines()[0]}; "
                                 "delete the step group or start with --new") from None
        try:  # a chunk file deleted reads as the fill value above: the digests its stage stored catch it
            store.verify(step)
        except Exception as exc:
            raise PreflightError(f"{where} is damaged: {str(exc).strip().splitlines()[0]}; "
                                 "delete the step group or start with --new") from None


def _check_policies(folder) -> None:
    from storage.policies import PolicyStoreError

    store = folder.policy_store()
    root = Path(store.root)
    versions = sorted(int(p.name[1:]) for p in root.glob("v*") if p.name[1:].isdigit() and store.is_complete(int(p.name[1:])))
    for v in versions:
        try:
            store.verify(v)
        except PolicyStoreError as exc:
            raise PreflightError(str(exc).splitlines()[0]) from None


def check_run_config(cfg: GRPOConfig, folder) -> dict[str, Any] | None:
    """The run folder's run.json when it was started with ``cfg`` (but safe keys); None when it has
    none. Cheap: also asked of a finished run, which a changed config must not pass as "nothing to do"."""
    from storage.run_folder import RunFolderError

    try:
        state = folder.load_run_state()
    except RunFolderError as exc:
        raise PreflightError(str(exc).splitlines()[0]) from None
    if state is not None:
        _check_config(cfg, state, folder)
    return state


def check_run_folder(cfg: GRPOConfig, folder) -> dict[str, Any] | None:
    """An existing run folder the run may resume: same config (but safe keys), readable steps, policy
    versions matching their manifests. Returns its run.json (None for a fresh folder)."""
    state = check_run_config(cfg, folder)
    if state is None and (Path(folder.rollouts).exists() or Path(folder.policies).exists()):
        raise PreflightError(f"run folder {folder.root} holds steps but no run.json, so its config is unknown; "
                             "run with --new (or another run_name) to start over")
    _check_steps(cfg, folder)
    _check_policies(folder)
    return state


def check_task_prompts(cfg: GRPOConfig) -> None:
    """The prompts of the run, tokenised by model.path's tokenizer as the rollout does (chat template
    and BOS included), fit the step layout's prompt width; a file dataset is read and checked whole
    (overflow: refuse names the line)."""
    from stages.data import DatasetError, open_prompt_source
    from stages.policy.tokenizer import TextCodec

    try:
        codec = TextCodec.from_policy_folder(cfg.model.path, cfg.dataset.chat_template, cfg.dataset.system_prompt)
    except Exception as exc:
        raise _model_error(Path(cfg.model.path), f"tokenizer.json cannot be used: "
                                                 f"{str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__}") from None
    top = max(codec.tokenizer.get_vocab(with_added_tokens=True).values(), default=-1)
    rows = cfg.model_shape.vocab_size  # config.json's vocab_size
    if top >= rows:
        raise _model_error(Path(cfg.model.path), f"tokenizer.json has token id {top}, the model's vocabulary (config.json "
                                                 f"vocab_size) ends at {rows - 1}: the tokenizer is not the model's")
    try:
        source = open_prompt_source(cfg.dataset, codec, cfg.task.prompts_per_step)
    except DatasetError as exc:
        raise PreflightError(str(exc).strip().splitlines()[0]) from None
    if source.num_steps is not None and cfg.iterations > source.num_steps:
        raise PreflightError(f"iterations={cfg.iterations} is past the {source.num_steps} steps {cfg.dataset.path} "
                             f"gives at dataset.epochs={cfg.dataset.epochs} and task.prompts_per_step="
                             f"{cfg.task.prompts_per_step}: raise dataset.epochs or lower iterations")
    if source.prompt_width > cfg.prompt_width:
        raise PreflightError(
            f"prompts take up to {source.prompt_width} tokens under model.path's tokenizer, the step layout's "
            f"prompt width is {cfg.prompt_width}: raise dataset.max_prompt_tokens (or use dataset.overflow=truncate)")


def check_devices(cfg: GRPOConfig) -> None:
    """rollout.device and train.device name devices this machine has (the embedded cluster's
    engines and ranks run here), a GPU per training rank for train.device=cuda."""
    from stages.rollout.engine import engine_placement
    from stages.train.engine import cuda_layout_error, train_placement

    t = cfg.train
    try:
        engine_placement(cfg.rollout.device, cfg.rollout.dtype)
        device, _ = train_placement(t.device, t.dtype, 0, t.layout.world_size)
    except ValueError as exc:
        raise PreflightError(str(exc)) from None
    error = cuda_layout_error(t.schedule, t.virtual_pipeline_model_parallel_size) if device.type == "cuda" else None
    if error:
        raise PreflightError(error)


def preflight(cfg: GRPOConfig, folder) -> dict[str, Any] | None:
    """Every check that needs no cluster, in the order a user would fix them; returns run.json of a
    resumed run (None for a new one). Raises :class:`PreflightError`."""
    check_devices(cfg)
    if cfg.model.path:
        check_model_folder(cfg.model.path)
        check_task_prompts(cfg)
        warn_pretrained_lr(cfg)
    if cfg.rollout.draft_path:
        check_draft_folder(cfg)
    check_eval_data(cfg)
    return check_run_folder(cfg, folder)


PRETRAINED_LR_WARN = 1e-4
"""A train.lr above this on a pretrained model (model.path) is warned about: full fine-tuning
with AdamW at the built-in toy's 1e-3 moves such a model far in one step (SmolLM2-135M: KL to the
reference 2.5 per token after one step; configs/smollm2-arithmetic.yaml trains at 2e-5)."""


def warn_pretrained_lr(cfg: GRPOConfig) -> bool:
    """Warn (and return True) when a pretrained model is set to train at more than PRETRAINED_LR_WARN
    (train.lr=auto picks a pretrained rate of its own)."""
    if not cfg.model.path or cfg.lr <= PRETRAINED_LR_WARN:
        return False
    log.warning("train.lr=%g: that is a rate for the built-in toy model; a pretrained model (model.path) usually trains "
                "at 1e-6 to 5e-5 with AdamW (train.lr=auto: 2e-5, the rate measured on SmolLM2-135M)", cfg.lr)
    return True


def check_draft_folder(cfg: GRPOConfig) -> None:
    """rollout.draft_path: an HF folder the engines can load, with the policy's vocabulary (the
    draft's tokens are the policy's)."""
    try:
        check_model_folder(cfg.rollout.draft_path)
    except PreflightError as exc:
        raise PreflightError(f"rollout.draft_path: {exc}") from None
    draft = load_hf_config(cfg.rollout.draft_path).get("vocab_size")
    policy = cfg.model_shape.vocab_size if cfg.model.path else None
    if policy is not None and draft != policy:
        raise PreflightError(f"rollout.draft_path={cfg.rollout.draft_path}: vocab_size {draft} differs from the "
                             f"policy's {policy}; a draft proposes the policy's tokens")


def check_eval_data(cfg: GRPOConfig) -> None:
    """eval.path readable with its prompt and answer fields: found now, not after the training that
    runs before the first evaluation finishes."""
    if not cfg.eval.enabled:
        return
    from flows.evaluate import eval_dataset
    from stages.data import DatasetError
    from stages.data.readers import read_records

    try:
        read_records(eval_dataset(cfg))
    except DatasetError as exc:
        raise PreflightError(f"eval.path: {str(exc).strip().splitlines()[0]}") from None
