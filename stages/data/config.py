"""The ``dataset:`` section of a run: where prompts come from and how a step draws them."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

__all__ = ["DatasetConfig", "DatasetError", "SOURCE_KINDS", "OVERFLOW_POLICIES", "RESERVED_FIELDS"]

SOURCE_KINDS = ("addition", "jsonl", "parquet", "hf")
OVERFLOW_POLICIES = ("refuse", "truncate")
# Keyword names a reward function receives from the runtime itself; a data field may not reuse them.
RESERVED_FIELDS = ("prompt", "completion")


class DatasetError(ValueError):
    """A dataset setting or a record is wrong; the message names the key or the file, row and field."""


@dataclass(frozen=True, kw_only=True, slots=True)
class DatasetConfig:
    kind: str = "addition"
    """Where prompts come from: ``addition`` (the built-in synthetic task, generated per step),
    ``jsonl`` (one JSON object per line), ``parquet`` (one row per record) or ``hf`` (a local
    Hugging Face ``datasets`` folder written by ``Dataset.save_to_disk``; needs ``datasets``)."""
    path: Optional[str] = None
    """The file (jsonl, parquet) or folder (hf); unset for ``addition``."""
    prompt_field: str = "prompt"
    """Field holding the prompt: a string, or a list of chat messages ``{"role", "content"}`` (roles
    system, user, assistant) ending in a user turn, rendered by the chat template as given. Rewards
    receive the prompt text as ``prompt=`` (a messages list: its last user message)."""
    answer_field: Optional[str] = "answer"
    """Field holding the ground truth, passed to reward functions as ``answer=`` (as a string);
    unset: records carry no answer. Every other field is passed to rewards under its own name."""
    shuffle: bool = True
    """Visit records in a seeded random order, a fresh permutation each epoch; false: file order."""
    seed: int = 0
    """Seed of the per-epoch permutations (addition: of the generated operands)."""
    epochs: Optional[int] = None
    """Passes over the data; the run may take ``floor(epochs * num_records / prompts_per_step)``
    steps. Unset: the data repeats for as many steps as the run asks."""
    max_prompt_tokens: Optional[int] = None
    """Longest prompt in tokens as the policy sees it (chat template and BOS included); unset: no
    limit. The step layout's prompt width is the longest prompt after this limit."""
    overflow: str = "refuse"
    """A prompt over ``max_prompt_tokens``: ``refuse`` (the data fails to load, naming the row) or
    ``truncate`` (its text is cut to fit, and counted)."""
    chat_template: bool = True
    """Render each prompt with the policy tokenizer's chat template (one user message, the
    generation prompt added), when the tokenizer folder has one; false: the raw text (plus BOS)."""
    system_prompt: Optional[str] = None
    """A system message before every prompt (e.g. "Answer with the number only."); unset: the chat
    template's own default, if it has one. A messages-list prompt with its own system message keeps
    that one. Without a chat template it is put before the prompt text, a blank line between."""
    num_digits: int = 2
    """``addition`` only: operands are drawn uniformly from [0, 10**num_digits)."""

    def __post_init__(self) -> None:
        if self.kind not in SOURCE_KINDS:
            raise DatasetError(f"dataset.kind={self.kind!r} is not one of {', '.join(SOURCE_KINDS)}")
        if self.overflow not in OVERFLOW_POLICIES:
            raise DatasetError(f"dataset.overflow={self.overflow!r} is not one of {', '.join(OVERFLOW_POLICIES)}")
        if self.kind == "addition":
            if self.path is not None:
                raise DatasetError(f"dataset.path={self.path!r} is set but dataset.kind=addition generates its "
                                   "prompts: unset dataset.path or set dataset.kind to jsonl, parquet or hf")
            if not 1 <= self.num_digits <= 6:
                raise DatasetError(f"dataset.num_digits={self.num_digits} must be in 1..6")
        elif not self.path:
            raise DatasetError(f"dataset.kind={self.kind} needs dataset.path (the {self.kind} file or folder)")
        if not self.prompt_field:
            raise DatasetError("dataset.prompt_field must name the field holding the prompt text")
        if self.answer_field == self.prompt_field:
            raise DatasetError(f"dataset.answer_field={self.answer_field!r} equals dataset.prompt_field: name "
                               "the ground-truth field, or unset dataset.answer_field")
        if self.epochs is not None and self.epochs < 1:
            raise DatasetError(f"dataset.epochs={self.epochs} must be >= 1 (or unset to repeat the data)")
        if self.system_prompt is not None and not self.system_prompt.strip():
            raise DatasetError("dataset.system_prompt is empty: give the system message's text, or unset it")
        if self.max_prompt_tokens is not None and self.max_prompt_tokens < 1:
            raise DatasetError(f"dataset.max_prompt_tokens={self.max_prompt_tokens} must be >= 1 (or unset)")
