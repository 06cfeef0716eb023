"""Prompt files as rows, and the stamp of their state: a JSONL file line by line, a parquet file or a saved Hugging Face dataset as
a pyarrow table. What a row means (the prompt, answer and fields of a record) is parsed in
stages/data/readers.py; an unreadable file is a :class:`DatasetError` naming it, in one line.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from stages.data.config import DatasetConfig, DatasetError
from storage.files import file_stamp

__all__ = ["jsonl_rows", "parquet_table", "hf_table", "dataset_stamp"]


def jsonl_rows(path: Path) -> list[tuple[str, dict[str, Any]]]:
    """(``path:line N``, object) of every non-blank line of a JSONL file, 1-based."""
    if not path.is_file():
        raise DatasetError(f"{path}: not found (dataset.path)")
    rows = []
    with path.open("rb") as f:
        for lineno, raw in enumerate(f, start=1):
            where = f"{path}:line {lineno}"
            if lineno == 1:
                raw = raw.removeprefix(b"\xef\xbb\xbf")  # a UTF-8 byte order mark, as some editors write
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                raise DatasetError(f"{where}: not UTF-8 (byte 0x{raw[exc.start]:02x} at column {exc.start + 1}); "
                                   "write the file as UTF-8") from None
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                raise DatasetError(f"{where}: not valid JSON ({exc.msg} at column {exc.colno})") from None
            if not isinstance(row, dict):
                raise DatasetError(f"{where}: a {type(row).__name__}, not a JSON object")
            rows.append((where, row))
    return rows


def parquet_table(path: Path):
    """A parquet file as a pyarrow table."""
    import pyarrow.parquet as pq

    if not path.is_file():
        raise DatasetError(f"{path}: not found (dataset.path)")
    try:
        return pq.read_table(path)
    except Exception as exc:  # pyarrow raises several types for a bad file
        raise DatasetError(f"{path}: not a readable parquet file ({exc})") from exc


def hf_table(path: Path):
    """A dataset written by ``save_to_disk`` (one split) as a pyarrow table, rows in dataset order."""
    try:
        from datasets import Dataset, DatasetDict, load_from_disk
    except ImportError as exc:
        raise DatasetError("dataset.kind=hf needs the datasets package: pip install 'grpoflow[hf]'") from exc
    if not path.is_dir():
        raise DatasetError(f"{path}: not found (dataset.path must be a folder written by save_to_disk)")
    try:
        ds = load_from_disk(str(path))
    except Exception as exc:
        raise DatasetError(f"{path}: not a saved Hugging Face dataset ({exc})") from exc
    if isinstance(ds, DatasetDict):
        splits = ", ".join(f"{path}/{name}" for name in ds)
        raise DatasetError(f"{path}: holds several splits; set dataset.path to one of {splits}")
    assert isinstance(ds, Dataset)
    return ds.with_format("arrow")[:]  # the rows in dataset order (any select/shuffle applied)


def dataset_stamp(cfg: DatasetConfig) -> tuple:
    """(path, :func:`~storage.files.file_stamp`) of every file the configured data is read from (none for the
    generated addition task): equal stamps mean data not rewritten since, so a cache of opened
    sources can key on it and a file edited between two runs on one cluster is read again."""
    if cfg.kind == "addition" or not cfg.path:
        return ()
    root = Path(cfg.path)
    files = [root] if root.is_file() else sorted(f for f in root.rglob("*") if f.is_file())
    return tuple((str(f), file_stamp(f)) for f in files)
