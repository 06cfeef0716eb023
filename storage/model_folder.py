"""The config.json of an HF model folder, read without torch: what config validation and the
planner need before any weights are loaded."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

__all__ = ["ModelFolderError", "load_hf_config"]


class ModelFolderError(ValueError):
    """An HF model folder is missing or its config.json is unreadable; the message names the file."""


def load_hf_config(path: str | Path) -> dict[str, Any]:
    """The parsed config.json of the model folder ``path``."""
    folder = Path(path)
    if not folder.is_dir():
        raise ModelFolderError(f"model.path={str(path)!r} is not a folder: give an HF model folder "
                               "(config.json, *.safetensors, tokenizer.json)")
    file = folder / "config.json"
    try:
        data = json.loads(file.read_text())
    except FileNotFoundError:
        raise ModelFolderError(f"{file}: not found; an HF model folder needs its config.json") from None
    except (OSError, ValueError) as exc:
        raise ModelFolderError(f"{file}: not valid JSON ({exc})") from None
    if not isinstance(data, dict):
        raise ModelFolderError(f"{file}: expected a JSON object, got {type(data).__name__}")
    return data
