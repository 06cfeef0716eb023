"""Prompt sources: the deterministic records of each GRPO step and the prompt width they need.

A file source lays its N records out as an endless stream of epochs, epoch ``e`` being the records
in the order of a permutation seeded by ``(seed, e)`` (identity when ``shuffle`` is off); step ``k``
takes stream positions ``[k * P, (k + 1) * P)`` with P = prompts per step. A step may therefore
straddle an epoch boundary, and the records of step k depend only on the seed, k and the data, so a
resumed or rerun step sees the same prompts. The addition source generates step k's prompts from
``(seed, k)`` (stages/tasks/addition.py).

Extra rounds (rollout.dynamic_sampling): round r >= 1 of step k gives P further records, drawn
apart from the stream, deterministic in ``(seed, k, r)``: a file source takes the first P records of
a permutation seeded by them (cycling when the data holds fewer than P), the addition source
generates them from ``(seed, k, r)``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional, Protocol

import numpy as np

from stages.data.config import DatasetConfig, DatasetError
from stages.data.readers import RawRecord, read_records
from stages.tasks.addition import answer_of, make_prompts

__all__ = ["PromptCodec", "PromptRecord", "PromptSource", "FilePromptSource", "AdditionPromptSource",
           "open_prompt_source"]


class PromptCodec(Protocol):
    """What a source needs from a tokenizer (stages/policy/tokenizer.py: TextCodec)."""

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...

    def encode_prompt(self, prompt: Any) -> list[int]: ...


@dataclass(frozen=True)
class PromptRecord:
    """One prompt of a step, as the rollout feeds it and the rewards judge it."""

    index: int
    """Position of the record in the data (addition: in the step)."""
    prompt: str
    """The prompt text (after truncation, if any); rewards receive it as ``prompt=``."""
    prompt_ids: tuple[int, ...]
    """Token ids the policy receives: chat template and BOS included."""
    answer: Optional[str]
    """Ground truth, passed to rewards as ``answer=``; None when the data has none."""
    fields: dict[str, Any] = field(default_factory=dict)
    """Other fields of the record, passed to rewards by name."""

    def reward_kwargs(self) -> dict[str, Any]:
        """Keyword arguments a reward function gets beside ``prompt`` and ``completion``."""
        return {**self.fields, **({} if self.answer is None else {"answer": self.answer})}


class PromptSource(Protocol):
    """The prompts of every step of a run."""

    prompt_width: int
    """Tokens of the longest prompt the source can give (the step layout's prompt width)."""
    num_steps: Optional[int]
    """Steps the data allows (None: unlimited)."""

    def records(self, step: int, round: int = 0) -> list[PromptRecord]: ...


def open_prompt_source(cfg: DatasetConfig, codec: PromptCodec, prompts_per_step: int) -> PromptSource:
    """The configured source, its records tokenised and checked against ``max_prompt_tokens``."""
    if prompts_per_step < 1:
        raise DatasetError(f"prompts_per_step={prompts_per_step} must be >= 1")
    if cfg.kind == "addition":
        return AdditionPromptSource(cfg, codec, prompts_per_step)
    return FilePromptSource(cfg, codec, prompts_per_step, read_records(cfg))


class FilePromptSource:
    """Records read from a file, tokenised once; see the module docstring for the step order."""

    def __init__(self, cfg: DatasetConfig, codec: PromptCodec, prompts_per_step: int,
                 raw: list[RawRecord]) -> None:
        self.cfg, self.prompts_per_step = cfg, prompts_per_step
        self.num_truncated = 0
        """Records whose prompt was cut to ``max_prompt_tokens`` (overflow=truncate)."""
        self._records = [self._tokenise(i, r, codec) for i, r in enumerate(raw)]
        self.prompt_width = max(len(r.prompt_ids) for r in self._records)
        n = len(self._records)
        self.num_steps = None if cfg.epochs is None else cfg.epochs * n // prompts_per_step
        if self.num_steps == 0:
            raise DatasetError(f"{cfg.path}: {n} records x dataset.epochs={cfg.epochs} do not fill one step of "
                               f"{prompts_per_step} prompts; raise dataset.epochs or lower prompts_per_step")

    @property
    def num_records(self) -> int:
        return len(self._records)

    def _tokenise(self, index: int, raw: RawRecord, codec: PromptCodec) -> PromptRecord:
        try:
            text, ids = raw.prompt, codec.encode_prompt(raw.messages or raw.prompt)
        except ValueError as exc:  # a messages list without a chat template
            raise DatasetError(f"{raw.where}: {exc}") from None
        limit = self.cfg.max_prompt_tokens
        if limit is not None and len(ids) > limit:
            if self.cfg.overflow == "refuse" or raw.messages:
                if raw.messages:
                    raise DatasetError(f"{raw.where}: field {self.cfg.prompt_field!r} is {len(ids)} tokens, over "
                                       f"dataset.max_prompt_tokens={limit}; a messages list is not truncated: "
                                       "raise the limit or shorten the messages")
                raise DatasetError(f"{raw.where}: field {self.cfg.prompt_field!r} is {len(ids)} tokens, over "
                                   f"dataset.max_prompt_tokens={limit}; raise it or set dataset.overflow=truncate")
            text, ids = _truncate(raw, codec, limit)
            self.num_truncated += 1
        return PromptRecord(index, text, tuple(ids), raw.answer, dict(raw.fields))

    def epoch_order(self, epoch: int) -> np.ndarray:
        """Record indices of one epoch, in the order the stream visits them."""
        n = len(self._records)
        if not self.cfg.shuffle:
            return np.arange(n)
        return np.random.default_rng([self.cfg.seed, 3, epoch]).permutation(n)

    def records(self, step: int, round: int = 0) -> list[PromptRecord]:
        """The ``prompts_per_step`` records of ``step``; ``round`` >= 1: of its extra round
        (module docstring)."""
        if step < 0 or round < 0:
            raise DatasetError(f"step={step}, round={round} must be >= 0")
        if self.num_steps is not None and step >= self.num_steps:
            raise DatasetError(f"{self.cfg.path}: step {step} is past the data's {self.num_steps} steps "
                               f"(dataset.epochs={self.cfg.epochs}); raise dataset.epochs or lower iterations")
        n, p = len(self._records), self.prompts_per_step
        if round:
            order = np.random.default_rng([self.cfg.seed, 4, step, round]).permutation(n)
            return [self._records[int(order[k % n])] for k in range(p)]
        out: list[PromptRecord] = []
        position = step * p
        while len(out) < p:
            epoch, offset = divmod(position, n)
            order = self.epoch_order(epoch)
            take = order[offset: offset + p - len(out)]
            out.extend(self._records[int(i)] for i in take)
            position += len(take)
        return out


def _truncate(raw: RawRecord, codec: PromptCodec, limit: int) -> tuple[str, list[int]]:
    """Cut the prompt text so its templated encoding fits ``limit`` tokens: drop text tokens from
    the end and re-render until it fits (token boundaries may merge, hence the loop)."""
    content = codec.encode(raw.prompt)
    keep = len(content)
    text, ids = raw.prompt, codec.encode_prompt(raw.prompt)
    while len(ids) > limit:
        keep -= len(ids) - limit
        if keep <= 0:
            raise DatasetError(f"{raw.where}: the chat template and BOS alone exceed dataset.max_prompt_tokens="
                               f"{limit}; raise it")
        text = codec.decode(content[:keep])
        ids = codec.encode_prompt(text)
    return text, ids


class AdditionPromptSource:
    """The built-in addition task through the source interface: prompts ``"a+b="``, answer a+b."""

    num_steps: Optional[int] = None

    def __init__(self, cfg: DatasetConfig, codec: PromptCodec, prompts_per_step: int) -> None:
        self.cfg, self.codec, self.prompts_per_step = cfg, codec, prompts_per_step
        widest = "9" * cfg.num_digits + "+" + "9" * cfg.num_digits + "="
        # One token per character at most past the template's own tokens (exact for the built-in
        # character tokenizer: BOS + 2 * num_digits + 2); records() checks every prompt against it.
        self.prompt_width = max(len(codec.encode_prompt(widest)), len(codec.encode_prompt("")) + len(widest))
        limit = cfg.max_prompt_tokens
        if limit is not None and self.prompt_width > limit:
            raise DatasetError(f"dataset.max_prompt_tokens={limit} is below the addition prompt width "
                               f"{self.prompt_width} (num_digits={cfg.num_digits}); raise it or unset it")

    def records(self, step: int, round: int = 0) -> list[PromptRecord]:
        out = []
        texts = make_prompts(self.cfg.seed, step, self.prompts_per_step, self.cfg.num_digits, round)
        for i, text in enumerate(texts):
            ids = tuple(self.codec.encode_prompt(text))
            if len(ids) > self.prompt_width:
                raise DatasetError(f"addition step {step} prompt {i} {text!r} is {len(ids)} tokens, over the "
                                   f"prompt width {self.prompt_width}")
            out.append(PromptRecord(i, text, ids, answer_of(text)))
        return out
