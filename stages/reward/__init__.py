"""Reward functions (a registry, or any importable function) and isolated scoring of whole groups.

A reward function is called with keyword arguments: ``prompt=`` and ``completion=`` (texts), plus
the sample's record fields (``answer=`` for the ground truth, and any other field of the data) that
its signature accepts (all of them if it takes ``**kwargs``). It returns a float; a sample's reward
is the sum over ``reward.functions``. Names are either registered short names (``exact_match``) or
import paths ``package.module:function``. It never evaluates model output as code.

Functions run in a separate process (stages/reward/isolated.py): a function that raises, runs past
its time limit, exceeds its memory limit, crashes its process or returns a non-finite value gives
the sample reward 0 and a ``failed`` flag, counted in the metrics; the iteration goes on.
Short names registered at run time in the parent are not seen by that process: register them in a
module and name its functions by import path.
"""

from __future__ import annotations

import importlib
import inspect
import math
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Optional, Sequence

import numpy as np

from stages.reward.isolated import RewardProcessError, SampleFailed, reward_process
from stages.tasks.addition import answer_of

__all__ = ["RewardFn", "REWARDS", "overlong_penalty", "register_reward", "get_reward", "resolve_reward", "accepted_fields",
           "check_reward_functions", "RewardFunctionError", "RewardProcessError", "ScoredGroups",
           "score_samples", "reward_labels", "merge_function_stats", "DEFAULT_MEMORY_LIMIT_BYTES"]

RewardFn = Callable[..., float]
REWARDS: dict[str, RewardFn] = {}
# Python with numpy and sympy loaded reserves about 200 MB of address space, with torch well over
# 1 GiB (a reward module may import it); 4 GiB leaves a reward room to work while a runaway
# allocation still fails fast.
DEFAULT_MEMORY_LIMIT_BYTES = 4 << 30
_FLOAT32_MAX = float(np.finfo(np.float32).max)
_STARTUP_TIMEOUT_S = 60.0  # importing the functions (sympy for math_answer) is not a sample's time


class RewardFunctionError(ValueError):
    """A name in ``reward.functions`` does not resolve to a usable function."""


def register_reward(name: str) -> Callable[[RewardFn], RewardFn]:
    def wrap(fn: RewardFn) -> RewardFn:
        if name in REWARDS:
            raise ValueError(f"reward {name!r} is already registered")
        REWARDS[name] = fn
        return fn
    return wrap


def get_reward(name: str) -> RewardFn:
    if name not in REWARDS:
        raise KeyError(f"reward {name!r} is not registered; known: {', '.join(sorted(REWARDS))}")
    return REWARDS[name]


def resolve_reward(name: str) -> RewardFn:
    """The function a name stands for: ``module.path:attr`` (attr may be dotted) or a registered name."""
    if ":" not in name:
        if name not in REWARDS:
            raise RewardFunctionError(f"{name!r} is not a registered reward (known: {', '.join(sorted(REWARDS))}); "
                                      "or give an import path package.module:function")
        return REWARDS[name]
    module_name, _, attr = name.partition(":")
    try:
        obj: Any = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        raise RewardFunctionError(f"{name!r}: module {module_name!r} not found ({exc}); grpoflow imports modules "
                                  "from the folder it runs in: run it from the folder holding the module's package, "
                                  "or add that folder to PYTHONPATH (on an existing cluster's workers too)") from None
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise RewardFunctionError(f"{name!r}: {module_name} has no attribute {attr!r}")
        obj = getattr(obj, part)
    if not callable(obj):
        raise RewardFunctionError(f"{name!r}: {attr} is a {type(obj).__name__}, not callable")
    return obj


def accepted_fields(fn: RewardFn) -> Optional[frozenset[str]]:
    """Keyword names ``fn`` accepts beside prompt / completion; None when it takes ``**kwargs``."""
    params = inspect.signature(fn).parameters.values()
    if any(p.kind is p.VAR_KEYWORD for p in params):
        return None
    return frozenset(p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY))


def check_reward_functions(names: Iterable[str], fields: Optional[Iterable[str]] = None) -> None:
    """Raise RewardFunctionError (one line naming the entry) unless every name resolves to a callable
    that accepts ``prompt=`` and ``completion=`` and needs no argument beyond them and ``fields``
    (when given: the record fields the data provides, e.g. ``answer``)."""
    available = None if fields is None else {"prompt", "completion", *fields}
    for i, name in enumerate(names):
        key = f"reward.functions[{i}]"
        try:
            fn = resolve_reward(name)
            signature = inspect.signature(fn)
        except RewardFunctionError as exc:
            raise RewardFunctionError(f"{key}={exc}") from None
        except (TypeError, ValueError):
            raise RewardFunctionError(f"{key}={name!r}: its signature cannot be read") from None
        accepted = accepted_fields(fn)
        for arg in ("prompt", "completion"):
            if accepted is not None and arg not in accepted:
                raise RewardFunctionError(f"{key}={name!r}: signature {signature} cannot take {arg}=; a reward "
                                          "is called as fn(prompt=..., completion=..., answer=..., ...)")
        required = [p.name for p in signature.parameters.values()
                    if p.default is p.empty and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
        if any(p.kind is p.POSITIONAL_ONLY and p.default is p.empty for p in signature.parameters.values()):
            raise RewardFunctionError(f"{key}={name!r}: signature {signature} has positional-only parameters; "
                                      "rewards are called with keywords")
        missing = [] if available is None else [r for r in required if r not in available]
        if missing:
            raise RewardFunctionError(f"{key}={name!r}: requires {', '.join(missing)}, which the data does not "
                                      f"provide (fields: {', '.join(sorted(available or ()))})")


@register_reward("exact_match")
def exact_match(prompt: str, completion: str, answer: Optional[str] = None) -> float:
    """1 if the completion is exactly the answer (default: the addition prompt's sum), else 0."""
    return 1.0 if completion.strip() == (answer_of(prompt) if answer is None else answer.strip()) else 0.0


@register_reward("digit_match")
def digit_match(prompt: str, completion: str, answer: Optional[str] = None) -> float:
    """Share of the answer's characters right in place (right-aligned), minus 0.1 per extra char;
    the answer defaults to the addition prompt's sum."""
    answer, got = (answer_of(prompt) if answer is None else answer.strip()), completion.strip()
    right = sum(a == b for a, b in zip(reversed(answer), reversed(got)))
    return right / len(answer) - 0.1 * max(0, len(got) - len(answer))


@register_reward("last_number")
def last_number(prompt: str, completion: str, answer: Optional[str] = None) -> float:
    """1 if the last number in the completion equals the answer (numerically: "81.0" and "81"
    agree, thousands commas dropped), else 0. For arithmetic, where math_answer would also accept an
    expression restated at the end ("... so 4 * 8 =" parses as 32), this takes only a number."""
    if answer is None:
        raise ValueError("last_number needs the ground truth: set dataset.answer_field")
    from stages.eval.metrics import final_answer

    got = final_answer(completion, "last_number")
    return 1.0 if got is not None and got == final_answer(answer, "last_number") else 0.0


# Registers math_answer; its heavy import (sympy) happens on first use.
from stages.reward import math_answer as _math_answer  # noqa: E402,F401


def overlong_penalty(length: np.ndarray, max_new_tokens: int, buffer: int, penalty: float) -> np.ndarray:
    """DAPO's soft overlong punishment [N] float32 of completion lengths [N]: 0 up to
    max_new_tokens - buffer tokens, then falling linearly to -penalty at max_new_tokens
    (reward.overlong_buffer, reward.overlong_penalty). buffer 0: zeros."""
    if buffer <= 0:
        return np.zeros(len(length), dtype=np.float32)
    if buffer >= max_new_tokens:
        raise ValueError(f"reward.overlong_buffer={buffer} must be below rollout.max_new_tokens={max_new_tokens}")
    over = np.clip(np.asarray(length, dtype=np.float64) - (max_new_tokens - buffer), 0, buffer)
    return (-penalty * over / buffer).astype(np.float32)


def reward_labels(functions: Sequence[str]) -> list[str]:
    """Short names of ``reward.functions`` for metric keys: the function's own name
    (``mytask.rewards:score`` -> ``score``), its whole path (":" as ".") where two would share one."""
    short = [name.rpartition(":")[2] for name in functions]
    return [s if short.count(s) == 1 else name.replace(":", ".") for s, name in zip(short, functions)]


@dataclass(frozen=True)
class ScoredGroups:
    reward: np.ndarray  # [N] float32
    failed: np.ndarray  # [N] bool
    first_error: str = ""
    """Why the first failed sample failed ("function: ExceptionType: message", a time-out, a dead
    process, a non-finite value); empty when none failed."""
    functions: tuple[str, ...] = ()
    """The reward functions, in the order of ``by_function``'s columns."""
    by_function: Optional[np.ndarray] = None
    """[N, len(functions)] float64: each function's value per sample; NaN where it failed, or where the
    sample's process timed out or died (then no function's value is known)."""
    function_errors: tuple[str, ...] = ()
    """Per function, why its first failed sample failed ("" if none did)."""

    def function_metrics(self) -> dict[str, dict[str, Any]]:
        """Per function label: {"sum", "scored", "failed", "first_error"} over these samples, for
        the step's ``reward/<label>`` (mean over scored samples) and ``reward_failed/<label>`` metrics.
        A sample whose process timed out or died is failed for every function."""
        if self.by_function is None:
            return {}
        out = {}
        for j, label in enumerate(reward_labels(self.functions)):
            col = self.by_function[:, j]
            ok = np.isfinite(col)
            out[label] = {"sum": float(col[ok].sum()), "scored": int(ok.sum()), "failed": int((~ok).sum()),
                          "first_error": self.function_errors[j]}
        return out


def merge_function_stats(into: dict[str, dict], more: dict[str, dict]) -> dict[str, dict]:
    """Add one scoring call's per-function stats (:meth:`ScoredGroups.function_metrics`) to ``into``."""
    for label, s in more.items():
        held = into.setdefault(label, {"sum": 0.0, "scored": 0, "failed": 0, "first_error": ""})
        held["sum"] += s["sum"]
        held["scored"] += s["scored"]
        held["failed"] += s["failed"]
        held["first_error"] = held["first_error"] or s["first_error"]
    return into


def score_samples(prompts: list[str], completions: list[str], functions: list[str], timeout_s: float,
                  fields: Optional[list[dict[str, Any]]] = None,
                  memory_limit_bytes: Optional[int] = DEFAULT_MEMORY_LIMIT_BYTES) -> ScoredGroups:
    """Sum of the reward functions for each sample, scored in a separate process.

    ``fields[i]`` holds sample i's record fields (``answer`` and the data's other fields), passed to
    the functions as keyword arguments. Each sample is limited to ``timeout_s`` of wall clock and the
    process to ``memory_limit_bytes`` of address space (None: no limit). A failed sample scores 0.
    Raises RewardProcessError only if the functions cannot be loaded at all.
    """
    if fields is not None and len(fields) != len(prompts):
        raise ValueError(f"fields has {len(fields)} entries for {len(prompts)} prompts")
    reward = np.zeros(len(prompts), dtype=np.float32)
    failed = np.zeros(len(prompts), dtype=bool)
    names = tuple(functions)
    by_function = np.full((len(prompts), len(names)), math.nan)
    errors = [""] * len(names)
    samples = [(p, c, {} if fields is None else fields[i]) for i, (p, c) in enumerate(zip(prompts, completions))]
    i, first_error = 0, ""
    while i < len(samples):  # a sample that kills or hangs the process ends a batch: go on on a fresh one
        proc = reward_process(names, memory_limit_bytes, _STARTUP_TIMEOUT_S)
        answers = proc.score_many(samples[i:], timeout_s)
        proc.log_output()
        for values in answers:
            if isinstance(values, SampleFailed):  # which function was running is not known
                why = str(values)
                errors = [e or why for e in errors]
            else:
                why = ""  # this sample's first failure
                for j, (name, value) in enumerate(zip(names, values)):
                    if not isinstance(value, str) and math.isfinite(value):
                        by_function[i, j] = value
                        continue
                    said = value if isinstance(value, str) else f"{name}: returned {value}, not a finite number"
                    errors[j] = errors[j] or said
                    why = why or said
            total = float(by_function[i].sum())
            # Finite in float64 may still overflow the float32 column.
            if not why and math.isfinite(total) and abs(total) <= _FLOAT32_MAX:
                reward[i] = total
            else:
                failed[i] = True
                first_error = first_error or why or f"{', '.join(names)}: returned {total}, not a finite number"
            i += 1
    return ScoredGroups(reward, failed, first_error, names, by_function, tuple(errors))
