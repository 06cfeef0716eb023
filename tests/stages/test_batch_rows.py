"""The global batch's rows and target, checked slot by slot against a per-sample construction
written out here, on padded, packed and bucketed layouts with failed rewards and a proximal pass."""

from __future__ import annotations

import numpy as np
import pytest

from stages.train.batch import PAD_DOC_ID, BucketedBatch, _trained, aggregation_weights, build_global_batch
from stages.train.buckets import bucketed_layout
from stages.train.loss import TARGET_FIELDS
from stages.train.plan import microbatch_layout
from test_microbatch_plan import make_arrays

_F = {name: k for k, name in enumerate(TARGET_FIELDS)}


def _expected(a: dict, samples, row, start, rows: int, T: int, weights, pad: int, trained):
    """One sample at a time: prompt then completion at (row, start), the target at the positions
    that predict completion tokens."""
    ids = np.full((rows, T), pad, np.int64)
    target = np.zeros((rows, T, len(TARGET_FIELDS)), np.float32)
    doc = np.full((rows, T), PAD_DOC_ID, np.int64)
    pos = np.zeros((rows, T), np.int64)
    prox = a.get("prox_logp", a["behav_logp"])
    for k, i in enumerate(samples):
        r, s, p, n = int(row[k]), int(start[k]), int(a["prompt_len"][i]), int(a["length"][i])
        ids[r, s:s + p], ids[r, s + p:s + p + n] = a["prompt_ids"][i, :p], a["tokens"][i, :n]
        doc[r, s:s + p + n], pos[r, s:s + p + n] = i, np.arange(p + n)
        at = slice(s + p - 1, s + p - 1 + n)
        target[r, at, _F["next_id"]] = a["tokens"][i, :n]
        target[r, at, _F["mask"]] = float(trained[i])
        target[r, at, _F["advantage"]] = a["advantage"][i]
        target[r, at, _F["old_logp"]] = a["behav_logp"][i, :n]
        target[r, at, _F["ref_logp"]] = a["ref_logp"][i, :n]
        target[r, at, _F["weight"]] = weights[i]
        target[r, at, _F["prox_logp"]] = prox[i, :n]
        target[r, at, _F["sample_id"]] = i
    return ids, target, doc, pos


def _step(seed: int, proximal: bool):
    rng = np.random.default_rng(seed)
    G, groups, Pw, Gw = 4, 6, 5, 7
    prompt_len = np.repeat(rng.integers(1, Pw + 1, groups), G)
    length = rng.integers(0, Gw + 1, groups * G)
    a = make_arrays(prompt_len, length, Pw, Gw, seed=seed)
    if proximal:
        a["prox_logp"] = a["behav_logp"] + 0.01
    failed = rng.random(groups * G) < 0.2
    return a, failed, G, groups, Pw, Gw


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("layout_kind", ["none", "padded", "packed", "bucketed"])
def test_rows_and_target_slot_by_slot(seed, layout_kind):
    a, failed, G, groups, Pw, Gw = _step(seed, proximal=seed == 1)
    layout = {"none": None,
              "padded": microbatch_layout(groups, G, Pw, Gw, 4 * (Pw + Gw), packing=False),
              "packed": microbatch_layout(groups, G, Pw, Gw, 4 * (Pw + Gw), packing=True, pack_row_tokens=Pw + Gw),
              "bucketed": bucketed_layout(groups, G, Pw, Gw, 4 * (Pw + Gw), [6, 9], packing=True, microbatches=2,
                                          max_microbatches=None)}[layout_kind]
    batch = build_global_batch(a, "seq-mean-token-mean", 0, layout, reward_failed=failed, group_size=G)
    trained = _trained(failed, G)
    weights = aggregation_weights(a["length"].astype(np.int64), Gw, "seq-mean-token-mean", trained)
    passes = batch.passes
    placed = np.zeros(len(failed), int)
    for p in passes:
        samples = np.arange(len(failed)) if p.samples is None else p.samples
        placed[samples] += 1
        row, start = p.sample_row, p.sample_col - a["prompt_len"][samples] + 1
        rows, T = p.input_ids.shape
        ids, target, doc, pos = _expected(a, samples, row, start, rows, T, weights, 0, trained)
        np.testing.assert_array_equal(p.input_ids.numpy(), ids)
        np.testing.assert_array_equal(p.target.numpy(), target)
        if p.doc_ids is not None:
            np.testing.assert_array_equal(p.doc_ids.numpy(), doc)
            np.testing.assert_array_equal(p.positions.numpy(), pos)
    assert (placed == 1).all()  # every sample in exactly one pass
    assert isinstance(batch, BucketedBatch) == (layout_kind == "bucketed")
    assert trained.sum() < len(trained)  # some samples are out of the loss
