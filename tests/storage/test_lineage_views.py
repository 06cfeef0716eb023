"""What lineage logs besides metrics: plots, the decoded-samples table, the array schema, and the
strict summary.json."""

from __future__ import annotations

import json
from pathlib import Path
import math
import struct

import numpy as np
import pytest

from stages.policy.tokenizer import TextCodec
from stages.tasks.addition import make_tokenizer_json
from storage.plots import PLOT_FILES, save_run_plots
from storage.rollouts import ARRAYS, RolloutStore, StepLayout
from storage.samples import SAMPLE_COLUMNS, load_sample_table
from storage.run_folder import RunFolder
from storage.summary import to_strict_json

STAGES = ("rollout", "reward", "train")


def _png_size(path) -> tuple[int, int]:
    head = path.read_bytes()[:24]
    assert head[:8] == b"\x89PNG\r\n\x1a\n"
    return struct.unpack(">II", head[16:24])  # IHDR width, height


def test_plots_are_pngs_of_the_documented_size(tmp_path):
    metrics = [{"step": s, "reward_mean": 0.3 + 0.1 * s, "reward_std": 0.4, "bubble_fraction": 0.2,
                "bubble_fraction_rank0": 0.1, "bubble_fraction_rank1": 0.3, "rollout_seconds": 1.0,
                "reward_seconds": 0.2, "train_seconds": 2.0} for s in range(3)]
    paths = save_run_plots(metrics, tmp_path / "plots", STAGES)
    assert [p.name for p in paths] == list(PLOT_FILES)
    for p in paths:
        assert _png_size(p) == (640, 360)  # 6.4 x 3.6 in at 100 dpi
    assert save_run_plots([], tmp_path / "none", STAGES) == []


def _store_with_one_step(tmp_path, codec: TextCodec):
    """A step of 3 groups of G = 2 whose text is known: prompt i is "i+1=", completions "1" and "2"."""
    store = RolloutStore(tmp_path / "rollouts.zarr")
    layout = StepLayout(num_prompts=3, group_size=2, prompt_width=6, max_new_tokens=4, groups_per_chunk=1)
    store.create_step(4, layout, policy_version=4, config_hash="x")
    n = layout.num_samples
    prompt_ids = np.full((n, 6), codec.pad_id, np.int32)
    prompt_len = np.zeros(n, np.int32)
    tokens = np.full((n, 4), codec.pad_id, np.int32)
    for i in range(n):
        p = [codec.bos_id] + codec.encode(f"{i // 2}+1=")
        prompt_ids[i, : len(p)], prompt_len[i] = p, len(p)
        c = codec.encode(str(i % 2 + 1)) + [codec.eos_id]
        tokens[i, : len(c)] = c
    arrays = {"prompt_ids": prompt_ids, "prompt_len": prompt_len, "tokens": tokens,
              "length": np.full(n, 2, np.int32), "reward": np.tile([1.0, 0.0], 3).astype(np.float32),
              "advantage": np.tile([0.5, -0.5], 3).astype(np.float32),
              "group_id": np.repeat(np.arange(40, 43), 2), "policy_version": np.full(n, 4, np.int32)}
    for name, values in arrays.items():
        store.write(4, name, values)
    return store


def test_sample_table_decodes_the_first_groups(tmp_path):
    tokenizer = tmp_path / "tokenizer.json"
    tokenizer.write_text(make_tokenizer_json())
    codec = TextCodec.from_json(tokenizer.read_text())
    store = _store_with_one_step(tmp_path, codec)
    table = load_sample_table(store.root, 4, codec.decode, num_groups=2)
    assert tuple(table) == SAMPLE_COLUMNS
    assert table["id"] == ["step=4/group=40/sample=0", "step=4/group=40/sample=1",
                           "step=4/group=41/sample=0", "step=4/group=41/sample=1"]
    assert table["prompt"] == ["0+1=", "0+1=", "1+1=", "1+1="]
    assert table["completion"] == ["1", "2", "1", "2"]
    assert table["reward"] == [1.0, 0.0, 1.0, 0.0] and table["advantage"] == [0.5, -0.5, 0.5, -0.5]
    assert table["policy_version"] == [4] * 4
    assert len(load_sample_table(store.root, 4, codec.decode, num_groups=10)["id"]) == 6  # capped at the step


def test_array_specs_follow_the_store(tmp_path):
    tokenizer_json = make_tokenizer_json()
    store = _store_with_one_step(tmp_path, TextCodec.from_json(tokenizer_json))
    specs = store.array_specs(4)
    assert set(specs) == set(ARRAYS)
    assert specs["tokens"] == ("int32", (6, 4)) and specs["prompt_ids"] == ("int32", (6, 6))
    assert specs["reward"] == ("float32", (6,)) and specs["reward_failed"] == ("bool", (6,))


def _reject(constant: str):
    raise ValueError(f"non-standard JSON constant {constant}")


def test_summary_is_strict_json(tmp_path):
    data = {"reward_mean": [0.5, float("nan")], "wall_seconds": float("inf"), "n": 3,
            "nested": {"x": np.float32(0.25), "y": (float("-inf"), 1)}}
    assert to_strict_json(data) == {"reward_mean": [0.5, None], "wall_seconds": None, "n": 3,
                                    "nested": {"x": 0.25, "y": [None, 1]}}
    path = RunFolder.at(tmp_path, "r").create().save_summary(data)
    loaded = json.loads(Path(path).read_text(), parse_constant=_reject)  # bare NaN / Infinity would raise
    assert loaded["reward_mean"] == [0.5, None] and loaded["wall_seconds"] is None
    assert not any(isinstance(v, float) and math.isnan(v) for v in loaded["reward_mean"])


def test_strict_json_keeps_finite_numbers_exact():
    assert to_strict_json([1e-300, -0.0, 2**53]) == [1e-300, -0.0, 2**53]
    with pytest.raises(ValueError):
        json.dumps(float("nan"), allow_nan=False)  # what RunFolder.save_summary relies on to refuse a stray NaN
