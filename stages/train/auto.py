"""What ``auto`` picks for training: train.length_buckets, train.packing,
train.logprob_chunk_tokens and train.lr, as pure functions of a run's shapes and model.

Each rule follows a measurement in docs/performance.md ("Defaults and what auto picks"):

- Length buckets pay when completions can be much shorter than max_new_tokens: on the bench shape
  (S = 7 + 64 = 71) packed buckets [16, 32, 71] halved the step (6.6 s against 13.6 s, 1.12 slots
  per real token against 2.98), and on SmolLM2 (S = 144) the step took 0.71-0.80x; on the tiny
  config (S = 13) buckets changed nothing (1.27 slots per real token either way).
- A packed row of 2S pays where dense attention is cheap: on SmolLM2 (S = 144) rows of 288
  holding two or three sequences each cut the slots of the stored steps from 1.27-1.37 to
  1.03-1.15 per real token, and a slot of a 288-wide row cost 1.3% more than one of a 144-wide row
  (15 layers forward and backward, dense document masks). Its attention adds
  attention_share(S) = 4.7% to a token's layer FLOPs there; the rule allows up to 10%.
- Packing pays only with buckets: with the single worst-case layout packed and padded rows hold
  the same slots and dense-mask attention over longer rows costs more (1.4-3.3x on a long tail);
  with buckets packed passes ran ~0.55x the time of padded ones.
- Chunked log-probs pay on a large vocabulary: only completion positions are projected, and the
  [tokens x vocab] logits never exist. At V >= 8,192 the chunked loss took 0.3-0.9x the full one's
  time with up to 3/4 of the positions scored; at the tiny vocabulary (15) it is 1.2-1.5x slower,
  by under a millisecond.
- The learning rate depends on where the weights come from. The built-in model, warmed up from
  random weights, trains at 1e-3 (the rate every tiny-config measurement used). A pretrained model
  (model.path) at that rate moved SmolLM2-135M to a KL of 2.5 per token in one step; at 2e-5 it went
  from 11.7% to 62.5% held-out accuracy in 8 steps (docs/evaluation.md), the one real-model rate
  measured here (that run's accuracy fell after 16 steps: a long run wants a decaying
  train.lr_schedule or a lower rate).

No torch: flows/config.py resolves these when it builds the layout.
"""

from __future__ import annotations

from typing import Optional, Sequence

from stages.train.buckets import power_of_two_widths

__all__ = ["MIN_BUCKET_WIDTH", "WIDE_ROW_MAX_ATTENTION_SHARE", "CHUNKED_LOGPROB_MIN_VOCAB", "LOGPROB_CHUNK_TOKENS",
           "BUILTIN_MODEL_LR", "PRETRAINED_LR", "auto_length_buckets", "auto_packing", "auto_logprob_chunk_tokens",
           "auto_lr"]

WIDE_ROW_MAX_ATTENTION_SHARE = 0.10  # a 2S packed row when its extra attention costs at most this (docstring)
MIN_BUCKET_WIDTH = 16  # narrowest auto bucket: the bench's tuned [16, 32, 71]; 8 holds a 7-token prompt + 1
CHUNKED_LOGPROB_MIN_VOCAB = 8192  # chunking won at every scored share up to 3/4 from here (module docstring)
LOGPROB_CHUNK_TOKENS = 256  # 0.36x the full path's peak at 4,096 tokens against 0.73x for 1,024, same time
BUILTIN_MODEL_LR = 1e-3  # the built-in model, trained from its warm-up
PRETRAINED_LR = 2e-5  # a model.path folder: SmolLM2-135M's measured rate (module docstring)


def auto_length_buckets(prompt_width: int, max_new_tokens: int, smallest: int = MIN_BUCKET_WIDTH, *,
                        budget: Optional[int] = None, attention_share: Optional[float] = None
                        ) -> Optional[tuple[int, ...]]:
    """train.length_buckets=auto: the powers of two from ``smallest`` up to S / 2, then
    S = prompt_width + max_new_tokens; None (one pass shaped for the worst case) when S < 2 x
    smallest. Each bucket is at most half as wide as the next, so a group moved into it saves at
    least half its row (a width close to S would save little and cost a pass of its own).

    Then 2S, a bucket of packed rows that hold two or more sequences of up to S, when the token
    budget of a microbatch (``budget``) holds such a row and the dense attention of a token over S
    more keys costs at most :data:`WIDE_ROW_MAX_ATTENTION_SHARE` of its layers' weight FLOPs
    (``attention_share``: stages/perf/flops.py ``attention_share(shape, S)``). The planner moves
    groups there only where that saves slots (stages/train/buckets.py); padded rows drop it.

    tiny (7 + 6 = 13): None; bench (7 + 64 = 71, budget 8 x 71, share 2.5%): (16, 32, 71, 142);
    SmolLM2 (96 + 48 = 144, budget 2 x 144, share 4.7%): (16, 32, 64, 144, 288); buckets the step's
    groups do not reach cost nothing (their schedules are built at first use)."""
    S = prompt_width + max_new_tokens
    widths = tuple(w for w in power_of_two_widths(S, smallest)[:-1] if 2 * w <= S)
    if not widths:
        return None
    wide = (budget is not None and budget >= 2 * S and attention_share is not None
            and attention_share <= WIDE_ROW_MAX_ATTENTION_SHARE)
    return (*widths, S, 2 * S) if wide else (*widths, S)


def auto_packing(length_buckets: Optional[Sequence[int]], pack_row_tokens: Optional[int]) -> bool:
    """train.packing=auto: on with length buckets (packed rows of each bucket's width) or when
    train.pack_row_tokens asks for packed rows; off for the single worst-case layout."""
    return length_buckets is not None or pack_row_tokens is not None


def auto_logprob_chunk_tokens(vocab_size: int) -> Optional[int]:
    """train.logprob_chunk_tokens=auto: :data:`LOGPROB_CHUNK_TOKENS` at a vocabulary of at least
    :data:`CHUNKED_LOGPROB_MIN_VOCAB` tokens, else None (full logits)."""
    return LOGPROB_CHUNK_TOKENS if vocab_size >= CHUNKED_LOGPROB_MIN_VOCAB else None


def auto_lr(pretrained: bool) -> float:
    """train.lr=auto: :data:`PRETRAINED_LR` for a model.path folder, else :data:`BUILTIN_MODEL_LR`."""
    return PRETRAINED_LR if pretrained else BUILTIN_MODEL_LR
