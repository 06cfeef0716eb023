"""Load a run config: YAML + ``key=value`` overrides, checked against the typed schema."""

from __future__ import annotations

from pathlib import Path

from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from flows.schema import ConfigError, GRPOConfig
from stages.data import DatasetError
from storage.model_folder import ModelFolderError

__all__ = ["load_config", "load_run_folder_config"]


def _first_line(exc: BaseException) -> str:
    return str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__


def load_config(path: str | Path | None = None, overrides: list[str] | tuple[str, ...] = (),
                base: dict | None = None) -> GRPOConfig:
    """The frozen config of a run (the YAML at ``path``, or ``base``: a config as run.json stores
    it), with ``overrides``. Raises :class:`ConfigError` with one line naming the bad key."""
    schema = OmegaConf.structured(GRPOConfig)
    layers = [schema]
    if base is not None:
        layers.append(OmegaConf.create(base))
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise ConfigError(f"config file {path} does not exist")
        try:
            layers.append(OmegaConf.load(path))
        except Exception as exc:  # yaml.YAMLError and friends
            raise ConfigError(f"{path}: not valid YAML: {_first_line(exc)}") from exc
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override {item!r} must look like key=value")
        try:
            layers.append(OmegaConf.from_dotlist([item]))
        except Exception as exc:  # a value that is not valid YAML: yaml.YAMLError and friends
            why = getattr(exc, "problem", None) or _first_line(exc)  # yaml's MarkedYAMLError says what it missed
            raise ConfigError(f"override {item!r}: not valid YAML: {why}") from None
    try:
        merged = OmegaConf.merge(*layers)
        cfg = OmegaConf.to_object(merged)
    except ConfigError:
        raise
    except (DatasetError, ModelFolderError) as exc:  # the dataset section's checks; an unreadable model.path
        raise ConfigError(_first_line(exc)) from None
    except OmegaConfBaseException as exc:
        key = getattr(exc, "full_key", None)
        where = f"{key}: " if key else ""
        raise ConfigError(f"{where}{_first_line(exc)}") from exc
    assert isinstance(cfg, GRPOConfig)
    return cfg


def load_run_folder_config(run_dir: str | Path, overrides: list[str] | tuple[str, ...] = ()) -> GRPOConfig:
    """The config a run folder (``runs/<run_name>``) was run with, from its run.json, with
    ``overrides``; runs_dir and run_name are where the folder is now (it may have been moved).
    Raises :class:`ConfigError` in one line when the folder holds no run.json with a config."""
    from storage.run_folder import RunFolder

    target = Path(run_dir).resolve()
    state = RunFolder.at(target.parent, target.name).load_run_state() if target.is_dir() else None
    if state is None or not isinstance(state.get("config"), dict):
        raise ConfigError(f"{target} holds no run.json with a config: give a run folder (runs/<run_name>)")
    return load_config(None, [*overrides, f"runs_dir={target.parent}", f"run_name={target.name}"],
                       base=state["config"])
