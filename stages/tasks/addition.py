"""Multi-digit addition: the prompt is ``"<bos>a+b="``, the verifiable answer is ``str(a + b)``.

Character-level vocabulary in HF tokenizers format. Prompts of a step are a pure function of
(seed, step), so a rerun regenerates the same prompts.
"""

from __future__ import annotations


import numpy as np
from tokenizers import Tokenizer, models, pre_tokenizers, decoders

__all__ = ["SPECIALS", "vocab_size", "make_tokenizer_json", "make_prompts", "parse_prompt", "answer_of",
           "warmup_pairs"]

SPECIALS = ("<pad>", "<bos>", "<eos>")
_CHARS = "0123456789+="


def vocab_size() -> int:
    """Tokens of :func:`make_tokenizer_json`'s vocabulary (15): the built-in model's embedding rows
    unless model.vocab_size is set."""
    return len(SPECIALS) + len(_CHARS)


def make_tokenizer_json() -> str:
    vocab = {tok: i for i, tok in enumerate(SPECIALS + tuple(_CHARS))}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.Split(pattern="", behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens(list(SPECIALS))
    return tok.to_str()


def make_prompts(seed: int, step: int, num_prompts: int, num_digits: int, round: int = 0) -> list[str]:
    """Prompt texts of one step (without the BOS token), deterministic in (seed, step); ``round``
    >= 1: of the step's extra round of prompts (rollout.dynamic_sampling), in (seed, step, round)."""
    rng = np.random.default_rng([seed, 1, step, *((round,) if round else ())])
    hi = 10 ** num_digits
    a, b = rng.integers(0, hi, size=num_prompts), rng.integers(0, hi, size=num_prompts)
    return [f"{x}+{y}=" for x, y in zip(a.tolist(), b.tolist())]


def parse_prompt(prompt: str) -> tuple[int, int]:
    left, _, _ = prompt.partition("=")
    a, _, b = left.partition("+")
    return int(a), int(b)


def answer_of(prompt: str) -> str:
    a, b = parse_prompt(prompt)
    return str(a + b)


def warmup_pairs(seed: int, num: int, num_digits: int) -> list[tuple[str, str]]:
    """(prompt, answer) pairs for the supervised warm-up, from a stream disjoint from GRPO steps."""
    rng = np.random.default_rng([seed, 2])
    hi = 10 ** num_digits
    a, b = rng.integers(0, hi, size=num), rng.integers(0, hi, size=num)
    return [(f"{x}+{y}=", str(x + y)) for x, y in zip(a.tolist(), b.tolist())]
