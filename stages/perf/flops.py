"""Model FLOPs of one GRPO step, counted from the model's shape, and the MFU they make.

Per token, with the planner's formula (:func:`planner.model.estimate_forward_flops_per_token`):

    weights    W = 2 * L * (layer weights)   2 FLOPs per weight per token (Kaplan 2020; PaLM App. B)
    lm_head    H = 2 * V * h                 only where a logit is used
    attention  K * c,  K = 4 * L * q_dim     a query against c keys: q.k and the weighted sum of v,
                                             2 matmuls x 2 FLOPs x q_dim per key per layer

The planner writes the attention of a whole causal sequence of length s as s tokens at K * s *
CAUSAL_ATTENTION_FLOP_FACTOR (half the s x s scores). Here the sum over positions is exact: the token
at position i (1-based) attends to i keys (itself and those before), so positions a..b cost

    body(a, b) = sum_{i=a..b} (W + K * i) = n * W + K * n * (a + b) / 2,   n = b - a + 1,

which for a..b = 1..s is s * W + K * s (s + 1) / 2: the planner's K * s^2 / 2 plus the diagonal.

A sample is a prompt of P tokens and a completion of C tokens. Every phase pushes the tokens it
must through the model once, with the lm_head only where its logits are used:

    score(P, C)   = body(1, P + C - 1) + C * H     positions P..P+C-1 predict the completion
    reference     = score                          forward only, when the step runs it (train.reference)
    train         = 3 * score                      backward = 2 x forward (input and weight grads)
    rollout       = per group: body(1, P) + H      prefill once, its last logits shared by the G samples
                    per sample: body(P + 1, P + C - 1) + (C - 1) * H
                                                   decode: each generated token after the first is
                                                   fed back once at its context; the last one never is

With ``group_size=1`` the rollout of a sample costs exactly its score. ``head_only_completion=False``
counts the lm_head on all P + C - 1 scored positions: what is needed is the default, whatever the
runtime projects (train.logprob_chunk_tokens set: completion tokens only; unset: every position).

These are model FLOPs (PaLM App. B): work the step needs, whatever the implementation does on top.
Not counted: padding, the trainer feeding the last completion token (it predicts nothing), the lm_head
on positions whose logits nobody reads (the reference pass's ``chunked_token_logp`` and the rollout
engine's prefill project every position of their rows), recomputation, and the elementwise work
(norms, RoPE, softmax, SiLU). The planner's weight count includes each layer's 2h RMSNorm weights
(and q/k/v biases) at 2 FLOPs each, which no matmul does: 0.03% of W for SmolLM2-135M (1,152 of
3,540,096 weights per layer), 0.8% for the tests' h=32 decoder (1.5% with Qwen2's biases).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Optional

import numpy as np

from planner.constants import CAUSAL_ATTENTION_FLOP_FACTOR
from planner.model import ModelShape as PlannerShape
from planner.model import estimate_forward_flops_per_token
from stages.layout import ModelShape

__all__ = ["STEP_PHASES", "attention_share", "forward_flops", "score_flops", "reference_flops", "train_flops",
           "rollout_flops", "step_model_flops", "mfu"]

STEP_PHASES = ("rollout", "reference", "train")
"""Keys of :func:`step_model_flops`."""
_BACKWARD_OVER_FORWARD = 2  # backward computes input and weight gradients: 2 matmuls per forward matmul


@dataclasses.dataclass(frozen=True)
class _PerToken:
    weights: float  # W: layers' matmul weights of one token
    head: float  # H: lm_head of one token
    per_key: float  # K: attention of one query per key it attends to


def _per_token(shape: ModelShape) -> _PerToken:
    """W, H and K from the planner's per-token formula, so planner and metric count the same FLOPs."""
    planner_shape = _planner_shape(shape)
    weights = estimate_forward_flops_per_token(planner_shape, 0, include_lm_head=False)
    head = estimate_forward_flops_per_token(planner_shape, 0) - weights
    # The planner's attention at context c is K * c * CAUSAL_ATTENTION_FLOP_FACTOR (a causal average).
    per_key = (estimate_forward_flops_per_token(planner_shape, 1, include_lm_head=False) - weights
               ) / CAUSAL_ATTENTION_FLOP_FACTOR
    return _PerToken(weights, head, per_key)


def _planner_shape(shape: ModelShape) -> PlannerShape:
    """The planner's subclass (it also reads ``gated_mlp``) of any shared shape, e.g. a DecoderConfig."""
    if isinstance(shape, PlannerShape):
        return shape
    fields = {f.name: getattr(shape, f.name) for f in dataclasses.fields(ModelShape)}
    return PlannerShape(**fields)


def _body(k: _PerToken, first: np.ndarray, last: np.ndarray) -> float:
    """sum over samples of body(first, last): positions first..last (1-based) through the layers."""
    n = np.maximum(last - first + 1, 0)
    return float(np.sum(n * k.weights + k.per_key * n * (first + last) / 2))


def _lengths(prompt_lens: Sequence[int], completion_lens: Sequence[int]) -> tuple[np.ndarray, np.ndarray]:
    p = np.asarray(prompt_lens, dtype=np.int64).reshape(-1)
    c = np.asarray(completion_lens, dtype=np.int64).reshape(-1)
    if p.shape != c.shape:
        raise ValueError(f"{p.size} prompt lengths but {c.size} completion lengths: pass one of each per sample")
    if p.size and (p.min() < 1 or c.min() < 0):
        raise ValueError(f"prompt lengths must be >= 1 and completion lengths >= 0 (got min {p.min()}, {c.min()})")
    return p, c


def attention_share(shape: ModelShape, keys: int) -> float:
    """K * keys / W: the attention FLOPs of a token that attends ``keys`` keys, over its layers'
    weight FLOPs. A packed row of width T runs attention under a dense mask, every token against all
    T keys, so widening packed rows by T' costs about attention_share(shape, T') more per slot in
    model FLOPs (stages/train/auto.py ``auto_length_buckets``)."""
    k = _per_token(shape)
    return k.per_key * keys / k.weights


def forward_flops(shape: ModelShape, seq_lens: Sequence[int]) -> float:
    """Forward FLOPs of sequences of ``seq_lens`` tokens each run whole, as ``DecoderStage(ids)``
    does: every position through the layers, causal attention, the lm_head on every position.
    Sum over sequences of body(1, s) + s * H."""
    k = _per_token(shape)
    s = np.asarray(seq_lens, dtype=np.int64).reshape(-1)
    return _body(k, np.ones_like(s), s) + float(s.sum()) * k.head


def score_flops(shape: ModelShape, prompt_lens: Sequence[int], completion_lens: Sequence[int], *,
                head_only_completion: bool = True) -> float:
    """Forward FLOPs of the log-probs of each sample's completion (one entry per sample):
    body(1, P + C - 1) + C * H (lm_head on all P + C - 1 positions unless ``head_only_completion``)."""
    k = _per_token(shape)
    p, c = _lengths(prompt_lens, completion_lens)
    scored = np.where(c > 0, p + c - 1, 0)  # a sample without a completion has nothing to score
    head_rows = c if head_only_completion else scored
    return _body(k, np.ones_like(p), scored) + float(head_rows.sum()) * k.head


def reference_flops(shape: ModelShape, prompt_lens: Sequence[int], completion_lens: Sequence[int], *,
                    head_only_completion: bool = True) -> float:
    """The frozen reference's log-probs: one forward, :func:`score_flops`."""
    return score_flops(shape, prompt_lens, completion_lens, head_only_completion=head_only_completion)


def train_flops(shape: ModelShape, prompt_lens: Sequence[int], completion_lens: Sequence[int], *,
                head_only_completion: bool = True) -> float:
    """Forward + backward of the policy over the trained samples: (1 + 2) * :func:`score_flops`.
    Several optimizer updates per step each pass over their own samples; pass them all."""
    forward = score_flops(shape, prompt_lens, completion_lens, head_only_completion=head_only_completion)
    return (1 + _BACKWARD_OVER_FORWARD) * forward


def rollout_flops(shape: ModelShape, prompt_lens: Sequence[int], completion_lens: Sequence[int], *,
                  group_size: int = 1) -> float:
    """Generating the completions with a KV cache (one entry per sample, the G samples of a prompt
    contiguous, as in ``RolloutBatch``): each group's prompt prefilled once, body(1, P) + H, then per
    sample body(P + 1, P + C - 1) + (C - 1) * H. ``group_size=1``: no prefix shared."""
    k = _per_token(shape)
    p, c = _lengths(prompt_lens, completion_lens)
    if group_size < 1 or p.size % group_size:
        raise ValueError(f"group_size={group_size} must be >= 1 and divide the {p.size} samples")
    groups = p.reshape(-1, group_size)
    if np.any(groups != groups[:, :1]):
        raise ValueError("the samples of a group must share one prompt length: pass rows grouped as RolloutBatch "
                         "holds them (prompt * group_size + sample), or group_size=1")
    prompts = groups[:, 0]
    prefill = _body(k, np.ones_like(prompts), prompts) + prompts.size * k.head
    decoded = np.maximum(c - 1, 0)
    decode = _body(k, p + 1, p + decoded) + float(decoded.sum()) * k.head
    return prefill + decode


def step_model_flops(shape: ModelShape, prompt_lens: Sequence[int], completion_lens: Sequence[int], *,
                     group_size: int, reference: bool, trained: Optional[Sequence[bool]] = None,
                     head_only_completion: bool = True) -> dict[str, float]:
    """Model FLOPs of one step's phases, keyed by :data:`STEP_PHASES`.

    prompt_lens, completion_lens: [num_samples], a RolloutBatch's ``prompt_len`` and ``length``.
    trained: [num_samples] the samples the step trains on (stages.advantage.trained_samples); None:
    all. The rollout generates every sample; the reference and the training pass score the trained
    ones. reference: whether the step runs the reference pass (0.0 when not).
    """
    p, c = _lengths(prompt_lens, completion_lens)
    keep = np.ones(p.size, dtype=bool) if trained is None else np.asarray(trained, dtype=bool).reshape(-1)
    if keep.shape != p.shape:
        raise ValueError(f"trained has {keep.size} entries for {p.size} samples: pass one per sample")
    forward = score_flops(shape, p[keep], c[keep], head_only_completion=head_only_completion)
    return {
        "rollout": rollout_flops(shape, p, c, group_size=group_size),
        "reference": forward if reference else 0.0,
        "train": (1 + _BACKWARD_OVER_FORWARD) * forward,
    }


def mfu(flops: float, seconds: float, rate: float, num_workers: int) -> float:
    """Model FLOPs utilisation: flops / (seconds * rate * num_workers).

    flops: a phase's model FLOPs (:func:`step_model_flops`); seconds: its wall time; rate: FLOP/s one
    worker can do (stages.perf.matmul_rate, measured with that worker's dtype, device and threads);
    num_workers: the processes that shared the phase's work, each at ``rate``. On the CPU a worker is
    one process with its own torch threads, so 2 training ranks of 1 thread each are rate(threads=1)
    and num_workers=2, and one rank of 2 threads is rate(threads=2) and num_workers=1; on GPUs a worker
    is one device (a TP group of 4 counts 4). Idle workers (pipeline bubbles, waiting) count: MFU
    says how much of what was held did model work.
    """
    if seconds <= 0 or rate <= 0 or num_workers < 1:
        raise ValueError(f"mfu needs seconds > 0, rate > 0 and num_workers >= 1 (got {seconds}, {rate}, "
                         f"{num_workers})")
    return flops / (seconds * rate * num_workers)


def step_mfu_metrics(flops: dict[str, float], stage_seconds: dict[str, float], iteration_seconds: float,
                     rate: float) -> dict[str, float]:
    """A step's MFU metrics against ``rate``, the FLOP/s of the whole machine the step ran on (every
    core of the host: storage.host_rates.matmul_rate with all its threads): ``model_flops_<phase>``,
    ``mfu_<phase>`` = the phase's FLOPs over its stage's seconds x rate, for the phases that ran,
    ``mfu`` = all the step's model FLOPs over its iteration seconds x rate, and the rate itself as
    ``matmul_flops_per_s``. The phases overlap
    in an asynchronous or colocated step, so each phase's figure is of its own stage's time."""
    out = {f"model_flops_{p}": f for p, f in flops.items()} | {"matmul_flops_per_s": rate}
    for phase, f in flops.items():
        seconds = stage_seconds.get(phase, 0.0)
        if f > 0 and seconds > 0:
            out[f"mfu_{phase}"] = mfu(f, seconds, rate, 1)
    if iteration_seconds > 0:
        out["mfu"] = mfu(sum(flops.values()), iteration_seconds, rate, 1)
    return out

