"""Prompt records from a JSONL file, a parquet file or a saved Hugging Face dataset: the rows that
storage/prompt_files.py reads, parsed into records.

Every bad record fails the whole load with one line naming the file, the line (JSONL, 1-based) or
row (parquet / hf, 0-based) and the field, so a dataset is fixed before a run spends any compute.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from stages.data.config import RESERVED_FIELDS, DatasetConfig, DatasetError
from storage import prompt_files  # the module: storage/prompt_files.py imports stages.data.config

__all__ = ["RawRecord", "read_records"]


@dataclass(frozen=True)
class RawRecord:
    """One record as stored: where it came from, its prompt text, answer and other fields."""

    where: str
    """``path:line 7`` or ``path row 6``; every error about the record starts with it."""
    prompt: str
    """The prompt text (of a messages list: its last user message)."""
    answer: Optional[str]
    fields: dict[str, Any] = field(default_factory=dict)
    """Every other field, passed to reward functions by name."""
    messages: Optional[tuple[dict[str, str], ...]] = None
    """The chat messages when the prompt field holds a list; None for a text prompt."""


_MISSING = object()  # a field absent from the record (None is a present null)


def read_records(cfg: DatasetConfig) -> list[RawRecord]:
    """All records of the configured file or folder (kinds jsonl, parquet, hf), in stored order."""
    path = Path(cfg.path or "")
    if cfg.kind == "jsonl":
        records = [_record(where, row, cfg) for where, row in prompt_files.jsonl_rows(path)]
    elif cfg.kind == "parquet":
        records = _read_table(prompt_files.parquet_table(path), str(path), cfg)
    elif cfg.kind == "hf":
        records = _read_table(prompt_files.hf_table(path), str(path), cfg)
    else:
        raise DatasetError(f"dataset.kind={cfg.kind} has no file to read")
    if not records:
        raise DatasetError(f"{path}: no records; a dataset needs at least one")
    return records


def _record(where: str, row: dict[str, Any], cfg: DatasetConfig) -> RawRecord:
    prompt = row.get(cfg.prompt_field, _MISSING)
    if prompt is _MISSING:
        raise DatasetError(f"{where}: missing field {cfg.prompt_field!r} (dataset.prompt_field); "
                           f"fields: {', '.join(map(str, row)) or 'none'}")
    messages = None
    if isinstance(prompt, (list, tuple)):
        messages = _messages(where, prompt, cfg.prompt_field)
        prompt = messages[-1]["content"]
    elif not isinstance(prompt, str):
        raise DatasetError(f"{where}: field {cfg.prompt_field!r} is {type(prompt).__name__}, not a string "
                           "or a list of chat messages")
    if not prompt.strip():
        raise DatasetError(f"{where}: field {cfg.prompt_field!r} is empty")
    answer = None
    if cfg.answer_field is not None:
        answer = _answer_text(where, row.get(cfg.answer_field, _MISSING), cfg.answer_field)
    fields = {k: v for k, v in row.items() if k not in (cfg.prompt_field, cfg.answer_field)}
    taken = set(RESERVED_FIELDS) | ({"answer"} if cfg.answer_field is not None else set())
    for name in fields:
        if name in taken:
            raise DatasetError(f"{where}: field {name!r} clashes with the reward argument of that name; "
                               "rename it in the data or point dataset.prompt_field / answer_field at it")
    return RawRecord(where, prompt, answer, fields, messages)


_ROLES = ("system", "user", "assistant")


def _messages(where: str, value: list | tuple, name: str) -> tuple[dict[str, str], ...]:
    """A prompt field's chat messages, checked: {"role", "content"} each, known roles, strings,
    the last a user turn."""
    if not value:
        raise DatasetError(f"{where}: field {name!r} is an empty list of messages")
    out = []
    for k, m in enumerate(value):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            raise DatasetError(f"{where}: field {name!r} message {k} is not {{\"role\": str, \"content\": str}}")
        if m["role"] not in _ROLES:
            raise DatasetError(f"{where}: field {name!r} message {k} has role {m['role']!r}, not one of "
                               f"{', '.join(_ROLES)}")
        out.append({"role": m["role"], "content": m["content"]})
    if out[-1]["role"] != "user":
        raise DatasetError(f"{where}: field {name!r} ends in a {out[-1]['role']!r} message; the last must be "
                           "the user's turn the model answers")
    return tuple(out)


def _answer_text(where: str, value: Any, name: str) -> str:
    """The ground truth as text: numbers written without a spurious ``.0``."""
    if value is _MISSING:
        raise DatasetError(f"{where}: missing field {name!r} (dataset.answer_field); unset "
                           "dataset.answer_field if the data has no answers")
    if isinstance(value, bool) or value is None or not isinstance(value, (str, int, float)):
        raise DatasetError(f"{where}: field {name!r} is {type(value).__name__}, not a string or number")
    if isinstance(value, float):
        if not math.isfinite(value):
            raise DatasetError(f"{where}: field {name!r} is {value}, not a finite number")
        return str(int(value)) if value.is_integer() else repr(value)
    return str(value)


def _read_table(table, path: str, cfg: DatasetConfig) -> list[RawRecord]:
    if cfg.prompt_field not in table.column_names:
        raise DatasetError(f"{path}: no column {cfg.prompt_field!r} (dataset.prompt_field); "
                           f"columns: {', '.join(table.column_names)}")
    if cfg.answer_field is not None and cfg.answer_field not in table.column_names:
        raise DatasetError(f"{path}: no column {cfg.answer_field!r} (dataset.answer_field); "
                           f"columns: {', '.join(table.column_names)}")
    return [_record(f"{path} row {i}", row, cfg) for i, row in enumerate(table.to_pylist())]
