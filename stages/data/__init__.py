"""Prompts from files (JSONL, parquet, a saved Hugging Face dataset) or the built-in addition task,
behind one interface: the deterministic records of each step and the prompt width they need."""

from stages.data.config import OVERFLOW_POLICIES, SOURCE_KINDS, DatasetConfig, DatasetError
from stages.data.readers import RawRecord, read_records
from stages.data.source import (AdditionPromptSource, FilePromptSource, PromptCodec, PromptRecord, PromptSource,
                                open_prompt_source)

__all__ = [
    "DatasetConfig", "DatasetError", "SOURCE_KINDS", "OVERFLOW_POLICIES", "RawRecord", "read_records",
    "PromptCodec", "PromptRecord", "PromptSource", "FilePromptSource", "AdditionPromptSource",
    "open_prompt_source",
]
