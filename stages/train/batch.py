"""Build the global batch of a step: fixed-shape token rows and the packed per-token target.

Sequence of sample i: prompt[:prompt_len] + tokens[:length] (s_i = prompt_len + length tokens).
Position t of a sequence predicts its token t + 1; completion token j sits at position
prompt_len + j, so the loss covers positions [prompt_len - 1, prompt_len - 1 + length).

Where the sequences go is the microbatch plan (stages/train/plan.py): the global batch is
num_microbatches x [rows, seq_len] slots, every step the same shape; unplanned, it is one row per
sample, right-padded to prompt_width + max_new_tokens. With length buckets
(stages/train/buckets.py) the step is a :class:`BucketedBatch`: a variable number of passes, each
a :class:`GlobalBatch` of one bucket's fixed shape holding a subset of the samples. Packed rows
carry ``doc_ids`` (the sample index; -1 on padding) and ``positions`` restarting at 0 per
sequence, handed to every pipeline stage through :meth:`GlobalBatch.stage_kwargs`.

The weight channel carries the aggregation's denominator over the *whole* global batch:
- token-mean:              w = 1 / (completion tokens in the batch)
- seq-mean-token-mean:     w = 1 / (length_i * samples in the batch)
- seq-mean-token-sum-norm: w = 1 / (max_new_tokens * samples in the batch)   (Dr. GRPO)
so a microbatch's loss is an exact partial sum whatever the plan (groups split or not).
Samples not trained on (a failed reward, or a group left with < 2 valid rewards:
stages.advantage.trained_samples) get mask 0 and weight 0, and the denominators count only the
trained samples and their tokens.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Optional

import numpy as np
import torch

from stages.advantage import trained_samples
from stages.train.buckets import BucketedLayout, BucketedPlan, plan_passes
from stages.train.loss import TARGET_FIELDS
from stages.train.plan import MicrobatchLayout, MicrobatchPlan, plan_microbatches

__all__ = ["GlobalBatch", "BucketedBatch", "build_global_batch", "aggregation_weights", "PAD_DOC_ID"]

PAD_DOC_ID = -1  # padding slots form a document of their own: they attend only to padding


@dataclass(frozen=True, eq=False)
class GlobalBatch:
    """One step's inputs for every pipeline rank: split on dim 0 into the run's microbatches, with
    where each sample sits (for mapping per-token outputs back to store order)."""

    input_ids: torch.Tensor  # [rows, T] long
    target: torch.Tensor  # [rows, T, len(TARGET_FIELDS)] float32
    num_tokens: int
    positions: Optional[torch.Tensor] = None  # [rows, T] long, packed layouts only
    doc_ids: Optional[torch.Tensor] = None  # [rows, T] long, packed layouts only
    sample_row: Optional[np.ndarray] = None  # [N]: global row of sample i
    sample_col: Optional[np.ndarray] = None  # [N]: column whose output predicts its first completion token
    length: Optional[np.ndarray] = None  # [N]: completion tokens of sample i
    max_new_tokens: int = 0  # Gw, the stored completion width
    plan: Optional[MicrobatchPlan] = None  # None: one padded row per sample, in store order
    num_microbatches: Optional[int] = None
    """Bucketed passes: microbatches of this pass over all data-parallel ranks (D x m); None: the
    run's fixed count (the engine's TrainSetup.num_microbatches per data-parallel rank)."""
    samples: Optional[np.ndarray] = None  # bucketed passes: [n] store indices of the samples held
    num_real_tokens: int = 0  # prompt + completion tokens of the samples held

    @property
    def num_samples(self) -> int:
        return int(len(self.length)) if self.length is not None else int(self.input_ids.shape[0])

    @property
    def passes(self) -> tuple["GlobalBatch", ...]:
        """The pipeline passes of the step: this batch alone."""
        return (self,)

    @property
    def slots_per_real_token(self) -> float:
        """train_token_slots_per_real_token (stages/train/buckets.py): every slot of the batch over
        prompt + completion tokens."""
        return self.input_ids.numel() / max(self.num_real_tokens, 1)

    def stage_kwargs(self) -> dict[str, torch.Tensor]:
        """Keyword tensors for every pipeline stage's forward, split on dim 0 like input_ids:
        ``positions`` and ``doc_ids`` [rows, T] for packed rows; nothing for padded rows (plain
        causal attention, positions 0..T-1)."""
        if self.doc_ids is None:
            return {}
        return {"positions": self.positions, "doc_ids": self.doc_ids}

    def completion_values(self, values: torch.Tensor | np.ndarray) -> np.ndarray:
        """Per-token outputs [rows, T] (e.g. reference log-probs) back in store order: [N, Gw]
        float32 holding completion token j of sample i at [i, j], and 0 past its length."""
        values = values.detach().cpu().numpy() if isinstance(values, torch.Tensor) else np.asarray(values)
        j = np.arange(self.max_new_tokens)
        valid = j[None, :] < self.length[:, None]  # (N, Gw)
        cols = np.where(valid, self.sample_col[:, None] + j[None, :], 0)
        return np.where(valid, values[self.sample_row[:, None], cols], 0.0).astype(np.float32)

    def completion_mask(self) -> torch.Tensor:
        """[rows, T] bool: the positions whose outputs predict a completion token (those
        :meth:`with_completion_values` writes)."""
        i, j = _ragged(self.length.astype(np.int64))
        mask = torch.zeros(self.input_ids.shape, dtype=torch.bool)
        mask[torch.from_numpy(self.sample_row[i]), torch.from_numpy(self.sample_col[i] + j)] = True
        return mask

    def with_completion_values(self, field: str, values: np.ndarray) -> "GlobalBatch":
        """This batch with target channel ``field`` holding per-sample completion values [N, Gw]
        (store order, e.g. reference log-probs) at the positions predicting each completion token:
        the inverse of :meth:`completion_values`. The values go in as they are, so the target is the
        one :func:`build_global_batch` gives for arrays holding them, bit for bit."""
        values = np.asarray(values, dtype=np.float32)
        if values.shape != (self.num_samples, self.max_new_tokens):
            raise ValueError(f"{field}: values of shape {values.shape} for {self.num_samples} samples of "
                             f"{self.max_new_tokens} completion tokens")
        i, j = _ragged(self.length.astype(np.int64))
        target = self.target.clone()
        target[torch.from_numpy(self.sample_row[i]), torch.from_numpy(self.sample_col[i] + j),
               TARGET_FIELDS.index(field)] = torch.from_numpy(values[i, j])
        return replace(self, target=target)


def aggregation_weights(length: np.ndarray, max_new_tokens: int, mode: str,
                        trained: Optional[np.ndarray] = None) -> np.ndarray:
    """Per-sample token weight w_i ([N] float64) for an aggregation mode; trained [N] bool (None:
    all) selects the samples in the loss: the others get 0 and are not counted in a denominator."""
    length = length.astype(np.float64)
    if trained is None:
        trained = np.ones(len(length), dtype=bool)
    n_samples = max(int(trained.sum()), 1)
    if mode == "token-mean":
        w = np.full(len(length), 1.0 / max(length[trained].sum(), 1.0))
    elif mode == "seq-mean-token-mean":
        w = np.where(length > 0, 1.0 / (np.maximum(length, 1.0) * n_samples), 0.0)
    elif mode == "seq-mean-token-sum-norm":
        w = np.full(len(length), 1.0 / (max_new_tokens * n_samples))
    else:
        raise ValueError(f"unknown loss aggregation {mode!r}")
    return np.where(trained, w, 0.0)


@dataclass(frozen=True, eq=False)
class BucketedBatch:
    """One step as a variable number of pipeline passes of fixed bucket shapes; the gradients of
    all passes accumulate before one optimiser step (every loss weight is global, so it is exact)."""

    passes: tuple[GlobalBatch, ...]
    plan: BucketedPlan
    num_tokens: int  # completion tokens of the step
    max_new_tokens: int

    @property
    def num_samples(self) -> int:
        return len(self.plan.seq_len)

    @property
    def slots_per_real_token(self) -> float:
        return self.plan.slots_per_real_token

    def completion_values(self, values: list) -> np.ndarray:
        """Per-pass per-token outputs ([rows_p, T_p] each, in pass order) back in store order [N, Gw]."""
        out = np.zeros((self.num_samples, self.max_new_tokens), np.float32)
        for p, v in zip(self.passes, values, strict=True):
            out[p.samples] = p.completion_values(v)
        return out

    def with_completion_values(self, field: str, values: np.ndarray) -> "BucketedBatch":
        """Every pass with its samples' rows of ``values`` [N, Gw] in target channel ``field``
        (:meth:`GlobalBatch.with_completion_values`)."""
        values = np.asarray(values, dtype=np.float32)
        return replace(self, passes=tuple(p.with_completion_values(field, values[p.samples]) for p in self.passes))


def build_global_batch(arrays: dict[str, np.ndarray], mode: str, pad_id: int,
                       layout: Optional[MicrobatchLayout | BucketedLayout] = None,
                       reward_failed: Optional[np.ndarray] = None,
                       group_size: Optional[int] = None,
                       untrained: Optional[np.ndarray] = None) -> GlobalBatch | BucketedBatch:
    """arrays: prompt_ids [N, Pw], prompt_len [N], tokens [N, Gw], length [N], behav_logp [N, Gw],
    ref_logp [N, Gw], advantage [N] (as stored in the rollout store), and optionally prox_logp
    [N, Gw] (the proximal policy of decoupled PPO; absent: behav_logp, i.e. on-policy).

    reward_failed: [N] bool, with group_size (samples of a group are contiguous): failed samples and
    groups left with < 2 valid samples are not trained on (mask 0, weight 0). None: all are.
    untrained: [N] bool, samples left out of the loss besides (train.overlong=mask: the truncated
    ones); they keep their place in their group's statistics, which the advantages already hold.

    layout: the run's fixed microbatch layout (plan.microbatch_layout), or its length buckets
    (buckets.bucketed_layout, giving a BucketedBatch); None gives one padded row per sample in store
    order, [N, Pw + Gw].
    """
    trained = _trained(reward_failed, group_size)
    if untrained is not None:
        trained = ~np.asarray(untrained, dtype=bool) & (True if trained is None else trained)
    if isinstance(layout, BucketedLayout):
        return _build_bucketed(arrays, mode, pad_id, layout, trained)
    prompt_ids, prompt_len = arrays["prompt_ids"], arrays["prompt_len"].astype(np.int64)
    tokens, length = arrays["tokens"], arrays["length"].astype(np.int64)
    N, Pw = prompt_ids.shape
    Gw = tokens.shape[1]
    if N and prompt_len.min() < 1:
        raise ValueError(f"sample {int(np.argmin(prompt_len))} has an empty prompt; every prompt holds "
                         f">= 1 token (BOS)")
    seq_len = prompt_len + length
    if layout is None:
        rows, T, plan = N, Pw + Gw, None
        row, start = np.arange(N, dtype=np.int64), np.zeros(N, dtype=np.int64)
    else:
        if layout.max_seq_len != Pw + Gw:
            raise ValueError(f"the layout is for sequences of up to {layout.max_seq_len} tokens, the step "
                             f"stores prompt width {Pw} + max_new_tokens {Gw} = {Pw + Gw}")
        plan = plan_microbatches(seq_len, layout)
        rows, T, row, start = layout.total_rows, layout.seq_len, plan.row, plan.start
    weights = aggregation_weights(length, Gw, mode, trained)
    ids, target, doc, pos = _fill_rows(arrays, np.arange(N), row, start, rows, T, weights, pad_id, trained)
    packed = layout is not None and layout.packing
    return GlobalBatch(
        torch.from_numpy(ids), torch.from_numpy(target), int(length.sum()),
        positions=torch.from_numpy(pos) if packed else None,
        doc_ids=torch.from_numpy(doc) if packed else None,
        sample_row=row, sample_col=start + prompt_len - 1, length=length, max_new_tokens=Gw, plan=plan,
        num_real_tokens=int(seq_len.sum()))


def _trained(reward_failed: Optional[np.ndarray], group_size: Optional[int]) -> Optional[np.ndarray]:
    """[N] bool: samples the loss trains on (stages/advantage.py:trained_samples); None: all."""
    if reward_failed is None:
        return None
    if group_size is None:
        raise ValueError("build_global_batch(reward_failed=...) needs group_size (rollout.group_size)")
    return trained_samples(~np.asarray(reward_failed, dtype=bool), group_size)


def _fill_rows(arrays: dict[str, np.ndarray], samples: np.ndarray, row: np.ndarray, start: np.ndarray,
               rows: int, T: int, weights: np.ndarray, pad_id: int, trained: Optional[np.ndarray]):
    """Token ids, target, doc ids and positions [rows, T] holding ``samples`` (store indices) at
    (row[k], start[k]); ``weights`` [N] are the global-batch token weights; ``trained`` [N] masks
    samples out of the loss (None: none). Every slot is written by one fancy-indexed assignment per
    array (the plan never overlaps two sequences): no Python loop over the samples."""
    samples = np.asarray(samples, dtype=np.int64)
    row, start = np.asarray(row, dtype=np.int64), np.asarray(start, dtype=np.int64)
    p = arrays["prompt_len"].astype(np.int64)[samples]  # [K]
    n = arrays["length"].astype(np.int64)[samples]  # [K]
    ids = np.full((rows, T), pad_id, dtype=np.int64)
    target = np.zeros((rows, T, len(TARGET_FIELDS)), dtype=np.float32)
    doc = np.full((rows, T), PAD_DOC_ID, dtype=np.int64)
    pos = np.zeros((rows, T), dtype=np.int64)
    # Every token of every sequence: k (its sample's place in ``samples``) and t (its position in it).
    k, t = _ragged(p + n)
    i, r, c = samples[k], row[k], start[k] + t
    in_prompt = t < p[k]
    ids[r, c] = np.where(in_prompt, arrays["prompt_ids"][i, np.where(in_prompt, t, 0)],
                         arrays["tokens"][i, np.where(in_prompt, 0, t - p[k])])
    doc[r, c], pos[r, c] = i, t
    # Every completion token j of every sample, at the position that predicts it: start + p - 1 + j.
    k, j = _ragged(n)
    i, r, c = samples[k], row[k], start[k] + p[k] - 1 + j
    prox_logp = arrays.get("prox_logp", arrays["behav_logp"])
    keep = np.ones(len(i), np.float32) if trained is None else trained[i].astype(np.float32)
    for field, values in (("next_id", arrays["tokens"][i, j]), ("mask", keep), ("advantage", arrays["advantage"][i]),
                          ("old_logp", arrays["behav_logp"][i, j]), ("ref_logp", arrays["ref_logp"][i, j]),
                          ("weight", weights[i]), ("prox_logp", prox_logp[i, j]), ("sample_id", i)):
        target[r, c, TARGET_FIELDS.index(field)] = values
    return ids, target, doc, pos


def _ragged(counts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(owner, offset) of every element of consecutive runs of ``counts`` [K] elements: for run k,
    owner k and offsets 0 .. counts[k] - 1."""
    owner = np.repeat(np.arange(len(counts)), counts)
    return owner, np.arange(len(owner)) - np.repeat(np.cumsum(counts) - counts, counts)


def _build_bucketed(arrays: dict[str, np.ndarray], mode: str, pad_id: int, layout: BucketedLayout,
                    trained: Optional[np.ndarray]) -> BucketedBatch:
    prompt_len, length = arrays["prompt_len"].astype(np.int64), arrays["length"].astype(np.int64)
    Pw, Gw = arrays["prompt_ids"].shape[1], arrays["tokens"].shape[1]
    if layout.max_seq_len != Pw + Gw:
        raise ValueError(f"the buckets are for sequences of up to {layout.max_seq_len} tokens, the step "
                         f"stores prompt width {Pw} + max_new_tokens {Gw} = {Pw + Gw}")
    if len(prompt_len) and prompt_len.min() < 1:
        raise ValueError(f"sample {int(np.argmin(prompt_len))} has an empty prompt; every prompt holds "
                         f">= 1 token (BOS)")
    plan = plan_passes(prompt_len + length, layout)
    weights = aggregation_weights(length, Gw, mode, trained)  # over the whole step: every pass a partial sum
    passes = []
    for p, (b, num_mb) in enumerate(zip(plan.pass_bucket, plan.pass_microbatches)):
        bucket = layout.buckets[b]
        samples = np.flatnonzero(plan.sample_pass == p)
        row, start = plan.row[samples], plan.start[samples]
        ids, target, doc, pos = _fill_rows(arrays, samples, row, start, num_mb * bucket.rows, bucket.seq_len,
                                           weights, pad_id, trained)
        passes.append(GlobalBatch(
            torch.from_numpy(ids), torch.from_numpy(target), int(length[samples].sum()),
            positions=torch.from_numpy(pos) if layout.packing else None,
            doc_ids=torch.from_numpy(doc) if layout.packing else None,
            sample_row=row, sample_col=start + prompt_len[samples] - 1, length=length[samples], max_new_tokens=Gw,
            num_microbatches=num_mb, samples=samples,
            num_real_tokens=int((prompt_len + length)[samples].sum())))
    return BucketedBatch(tuple(passes), plan, int(length.sum()), Gw)
