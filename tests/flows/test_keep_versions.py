"""train.keep_versions: a run keeps the newest N versions whole, v0, every keep_every-th and the
last; the others keep only their manifest, config and tokenizer, and the run still resumes exactly
where it stopped (the resume walk counts a dropped version as published). A tied embedding is
stored once, in the first pipeline stage's shard."""

from __future__ import annotations

import json

import pytest
from safetensors import safe_open

from flows.config import ConfigError, load_config
from flows.loop import remaining_steps, run, run_folder
from flows.run_loop import keeps_version
from storage.policies import PolicyStoreError

pytestmark = pytest.mark.slow


def _cfg(runs_dir, *extra):
    return load_config("configs/tiny.yaml", [f"runs_dir={runs_dir}", "run_name=keep", "warmup.steps=20",
                                             "task.prompts_per_step=8", "train.micro_batch_size=16",
                                             "train.keep_versions=2", "train.keep_every=3",
                                             "model.tie_word_embeddings=true", *extra])


def test_old_versions_lose_their_weights_and_the_run_resumes(tmp_path):
    run(_cfg(tmp_path, "iterations=5"), progress=False)
    store = run_folder(_cfg(tmp_path, "iterations=5")).policy_store()
    # v0 (reference), v3 (keep_every), v4 and v5 (the newest 2; v5 the last) whole; v1 and v2 dropped.
    assert [v for v in range(6) if not store.is_dropped(v)] == [0, 3, 4, 5]
    for v in (1, 2):
        path = store.version_path(v)
        assert not list(path.glob("*.safetensors")) and (path / "config.json").is_file()
        store.verify(v)  # a dropped version passes the resume check: nothing of it is read
        with pytest.raises(PolicyStoreError, match=rf"policy v{v}: its weights were deleted"):
            store.ref(v)
    # The tied embedding is stored once, in the first stage's shard; the index names that file.
    with safe_open(str(store.version_path(5) / "model-00001-of-00002.safetensors"), "pt") as first, \
            safe_open(str(store.version_path(5) / "model-00002-of-00002.safetensors"), "pt") as last:
        assert "model.embed_tokens.weight" in first.keys() and "model.embed_tokens.weight" not in last.keys()
    weight_map = json.loads((store.version_path(5) / "model.safetensors.index.json").read_text())["weight_map"]
    assert weight_map["model.embed_tokens.weight"] == "model-00001-of-00002.safetensors"
    before = (store.version_path(5) / "model.safetensors.index.json").read_bytes()
    more = _cfg(tmp_path, "iterations=7", "train.keep_every=6")  # safe to change on resume
    assert remaining_steps(more) == range(5, 7)  # v1, v2 dropped: still counted as published
    run(more, progress=False)
    assert [v for v in range(8) if not store.is_dropped(v)] == [0, 6, 7]  # the new rules hold for v3 too
    assert store.is_dropped(5) and not (store.version_path(5) / "model.safetensors.index.json").exists()
    assert before  # v5 was whole before the second process moved past it


def test_keep_rules_and_limits(tmp_path):
    cfg = _cfg(tmp_path, "iterations=30", "eval.path=data/arithmetic_test.jsonl", "eval.every_steps=4")
    assert [v for v in range(31) if keeps_version(cfg, v)] == [0, 3, 4, 6, 8, 9, 12, 15, 16, 18, 20, 21, 24,
                                                               27, 28, 30]
    with pytest.raises(ConfigError, match="train.keep_versions=0 must be >= 1"):
        _cfg(tmp_path, "train.keep_versions=0")


def test_an_async_run_keeps_what_its_stale_steps_start_from(tmp_path):
    """keep_versions below max_staleness + 2 is raised to it: step k may start from v(k - s - 1)."""
    cfg = _cfg(tmp_path, "iterations=4", "rollout.max_staleness=1", "train.keep_versions=1", "train.keep_every=0")
    run(cfg, progress=False)
    store = run_folder(cfg).policy_store()
    assert [v for v in range(5) if not store.is_dropped(v)] == [0, 2, 3, 4]


def test_publish_refuses_tied_embedding_copies_that_differ(tmp_path):
    from flows.results import TrainResult
    from flows.tasks import publish_task

    trains = tuple(TrainResult(rank=r, metrics={}, window_ns=(0, 1), shard_bytes=0, shard_seconds=0.0, task_start=0.0,
                               task_end=1.0, tied_sha256=c * 64) for r, c in ((0, "a"), (1, "b")))
    with pytest.raises(PolicyStoreError, match=r"policy v3: the training ranks' copies of the tied embedding differ "
                                               r"\(sha256 rank 0: aaaaaaaaaaaa, rank 1: bbbbbbbbbbbb\)"):
        publish_task(run_folder(_cfg(tmp_path)), None, 3, None, 2, None, trains)
