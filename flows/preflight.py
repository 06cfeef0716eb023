"""Checks a run makes before any work starts: each bad input is refused with one line naming the
key, file or sample, and nothing stored is changed.

- ``reward.functions``: every name resolves to a callable reward (stages/reward);
- ``model.path``: an HF folder with config.json of a supported model_type, tokenizer.json and
  safetensors holding every tensor the model needs at its configured shape;
- an existing run folder: started with the same config, except :data:`SAFE_TO_CHANGE` keys
  (run.json); its Zarr steps readable; its policy versions hashing to their manifests;
- prompts no longer than ``task.prompt_width`` under model.path's tokenizer (:func:`check_task_prompts`).

NaN or infinite rewards are not refused here: the reward stage marks those samples failed
(stages/reward ``score_samples``), and failed samples carry no gradient.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Iterable, Sequence

import numpy as np

from flows.schema import ConfigError, GRPOConfig, config_to_dict

__all__ = ["SAFE_TO_CHANGE", "PreflightError", "config_differences", "check_rewards", "check_model_folder",
           "check_run_folder", "check_prompt_lengths", "check_task_prompts", "preflight"]

SAFE_TO_CHANGE = ("iterations", "runs_dir", "cluster.", "mlflow.", "plan.")
"""Config keys (or key prefixes, ending in '.') a resumed run may change: they decide how long and
where the run goes, not what it computes. docs/reliability.md lists them."""


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


def check_rewards(names: Sequence[str]) -> None:
    from stages.reward import RewardFunctionError, check_reward_functions

    if not names:
        raise PreflightError("reward.functions is empty: name at least one reward, e.g. [exact_match]")
    try:
        check_reward_functions(names)
    except RewardFunctionError as exc:
        raise PreflightError(str(exc).strip().splitlines()[0]) from None


def _model_error(path: Path, what: str) -> PreflightError:
    return PreflightError(f"model.path={path}: {what}")


def check_model_folder(path: str | Path) -> None:
    """An HF folder the run can load: config.json (supported model_type), tokenizer.json and every
    tensor at the shape config.json implies; the safetensors headers are read, not the weights."""
    from safetensors import safe_open

    from stages.policy import DecoderConfig, build_stage, hf_named_parameters

    path = Path(path)
    if not path.is_dir():
        raise _model_error(path, "no such folder")
    cfg_file = path / "config.json"
    if not cfg_file.is_file():
        raise _model_error(path, "no config.json (an HF model folder holds config.json, tokenizer.json, *.safetensors)")
    try:
        hf = json.loads(cfg_file.read_text())
        if not isinstance(hf, dict):
            raise ValueError("not a JSON object")
    except ValueError as exc:
        raise _model_error(path, f"config.json is not valid JSON: {str(exc).splitlines()[0]}") from None
    try:
        model_cfg = DecoderConfig.from_hf(hf)
    except Exception as exc:  # unsupported model_type, missing or inconsistent sizes
        raise _model_error(path, f"config.json: {str(exc).strip().splitlines()[0] or type(exc).__name__}") from None
    if not (path / "tokenizer.json").is_file():
        raise _model_error(path, "no tokenizer.json (save the tokenizer with save_pretrained into the folder)")
    index = path / "model.safetensors.index.json"
    try:
        files = sorted(set(json.loads(index.read_text())["weight_map"].values())) if index.exists() \
            else ["model.safetensors"]
    except Exception as exc:
        raise _model_error(path, f"model.safetensors.index.json is unreadable: {str(exc).splitlines()[0]}") from None
    shapes: dict[str, tuple[int, ...]] = {}
    for name in files:
        f = path / name
        if not f.is_file():
            raise _model_error(path, f"weights file {name} is missing")
        try:
            with safe_open(str(f), framework="pt") as st:
                for k in st.keys():
                    shapes[k] = tuple(st.get_slice(k).get_shape())
        except Exception as exc:
            raise _model_error(path, f"{name} is not a readable safetensors file: "
                                     f"{str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__}") from None
    import torch

    with torch.device("meta"):
        expected = {n: tuple(p.shape) for n, p in hf_named_parameters(build_stage(model_cfg))}
    for name, shape in sorted(expected.items()):
        if name not in shapes:
            raise _model_error(path, f"tensor {name} is missing from the safetensors files")
        if shapes[name] != shape:
            raise _model_error(path, f"tensor {name} has shape {list(shapes[name])}, config.json implies {list(shape)}")


def check_prompt_lengths(prompt_ids: Iterable[Sequence[int]], width: int, where: str = "prompt") -> None:
    """Every tokenised prompt fits ``task.prompt_width`` tokens; the first that does not is named."""
    for i, ids in enumerate(prompt_ids):
        if len(ids) > width:
            raise PreflightError(f"{where} {i} has {len(ids)} tokens, longer than task.prompt_width={width}: "
                                 "raise the width or drop the prompt")


def _check_config(cfg: GRPOConfig, state: dict[str, Any], folder) -> None:
    stored = state.get("config")
    if not isinstance(stored, dict):
        raise PreflightError(f"{folder.run_state} holds no config; delete it or start with --new")
    diff = config_differences(stored, config_to_dict(cfg))
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


def check_run_folder(cfg: GRPOConfig, folder) -> dict[str, Any] | None:
    """An existing run folder the run may resume: same config (but safe keys), readable steps, policy
    versions matching their manifests. Returns its run.json (None for a fresh folder)."""
    from storage.run_folder import RunFolderError

    try:
        state = folder.load_run_state()
    except RunFolderError as exc:
        raise PreflightError(str(exc).splitlines()[0]) from None
    if state is not None:
        _check_config(cfg, state, folder)
    elif Path(folder.rollouts).exists() or Path(folder.policies).exists():
        raise PreflightError(f"run folder {folder.root} holds steps but no run.json, so its config is unknown; "
                             "run with --new (or another run_name) to start over")
    _check_steps(cfg, folder)
    _check_policies(folder)
    return state


def check_task_prompts(cfg: GRPOConfig) -> None:
    """The task's prompts of every step, tokenised by model.path's tokenizer as the rollout does
    (BOS + text), fit task.prompt_width."""
    from stages.policy.tokenizer import TextCodec
    from stages.tasks.addition import make_prompts

    path = Path(cfg.model.path) / "tokenizer.json"
    try:
        codec = TextCodec.from_json(path.read_text())
    except Exception as exc:
        raise _model_error(Path(cfg.model.path), f"tokenizer.json cannot be used: "
                                                 f"{str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__}") from None
    for step in range(cfg.iterations):
        texts = make_prompts(cfg.seed, step, cfg.task.prompts_per_step, cfg.task.num_digits)
        check_prompt_lengths(([codec.bos_id] + codec.encode(t) for t in texts), cfg.task.prompt_width,
                             where=f"step {step}: prompt")


def preflight(cfg: GRPOConfig, folder) -> dict[str, Any] | None:
    """Every check that needs no cluster, in the order a user would fix them; returns run.json of a
    resumed run (None for a new one). Raises :class:`PreflightError`."""
    check_rewards(cfg.reward.functions)
    if cfg.model.path:
        check_model_folder(cfg.model.path)
        check_task_prompts(cfg)
    return check_run_folder(cfg, folder)
