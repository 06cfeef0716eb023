"""The Zarr rollout store: layout, chunk-aligned writes, attributes, completion marks, errors."""

from __future__ import annotations

import multiprocessing
import threading
import warnings
from pathlib import Path

import numpy as np
import pytest
import zarr

from storage.rollouts import ARRAYS, RolloutStore, RolloutStoreError, StepLayout


def make_layout(**overrides) -> StepLayout:
    fields = dict(num_prompts=6, group_size=3, prompt_width=5, max_new_tokens=4, groups_per_chunk=2)
    fields.update(overrides)
    return StepLayout(**fields)


def make_store(tmp_path, step: int = 0, layout: StepLayout | None = None, policy_version: int = 2,
               config_hash: str = "cfg-abc") -> RolloutStore:
    store = RolloutStore(tmp_path / "rollouts.zarr")
    store.create_step(step, layout or make_layout(), policy_version=policy_version, config_hash=config_hash)
    return store


def make_values(name: str, layout: StepLayout, seed: int = 0) -> np.ndarray:
    """Random rows of one ARRAYS entry over the whole step."""
    dtype, kind = ARRAYS[name]
    tail = {"": (), "prompt": (layout.prompt_width,), "gen": (layout.max_new_tokens,)}[kind]
    rng = np.random.default_rng(seed)
    shape = (layout.num_samples, *tail)
    if dtype == "bool":
        return rng.random(shape) < 0.5
    if dtype.startswith("float"):
        return rng.standard_normal(shape).astype(dtype)
    return rng.integers(-100, 100, shape).astype(dtype)


def test_write_chunk_aligned_ranges_and_read_back(tmp_path):
    layout = make_layout()
    store = make_store(tmp_path, step=7, layout=layout)
    chunk = layout.chunk_samples
    for name in ARRAYS:
        values = make_values(name, layout, seed=len(name))
        for start in range(0, layout.num_samples, chunk):  # one writer per chunk, as the flows do
            store.write(7, name, values[start:start + chunk], start=start)
        got = store.read(7, name)[name]
        assert got.dtype == np.dtype(ARRAYS[name][0]), name
        assert np.array_equal(got, values), name
        part = store.read(7, name, start=chunk, stop=2 * chunk)[name]
        assert np.array_equal(part, values[chunk:2 * chunk]), name
    assert store.steps() == [7] and store.has_step(7) and not store.has_step(8)


def test_unwritten_arrays_read_as_zero(tmp_path):
    layout = make_layout()
    out = make_store(tmp_path, layout=layout).read(0, "reward", "reward_failed", "tokens")
    assert np.all(out["reward"] == 0) and not out["reward_failed"].any()
    assert out["tokens"].shape == (layout.num_samples, layout.max_new_tokens)


@pytest.mark.parametrize("num_prompts,group_size,groups_per_chunk", [(6, 3, 2), (5, 4, 2), (3, 8, 4),
                                                                     (1, 16, 4), (7, 1, 3)])
def test_chunks_are_whole_groups(tmp_path, num_prompts, group_size, groups_per_chunk):
    layout = make_layout(num_prompts=num_prompts, group_size=group_size, groups_per_chunk=groups_per_chunk)
    store = make_store(tmp_path, layout=layout)
    for name in ARRAYS:
        arr = zarr.open_array(store.array_path(0, name), mode="r")
        assert arr.shape[0] == num_prompts * group_size, name
        assert arr.chunks[0] % group_size == 0 and arr.chunks[0] > 0, name
        assert arr.chunks[0] == group_size * min(groups_per_chunk, num_prompts), name
        assert arr.chunks[1:] == arr.shape[1:], name  # a sample's row is never split


def test_attrs_record_lineage_and_layout(tmp_path):
    layout = make_layout(num_prompts=4, group_size=8)
    store = make_store(tmp_path, step=3, layout=layout, policy_version=11, config_hash="deadbeef")
    attrs = store.attrs(3)
    assert attrs["group_size"] == 8 and attrs["policy_version"] == 11 and attrs["config_hash"] == "deadbeef"
    assert attrs["complete"] == []
    assert store.layout(3) == layout


def test_create_step_again_forgets_marks_and_data(tmp_path):
    layout = make_layout()
    store = make_store(tmp_path, layout=layout)
    store.write(0, "reward", np.ones(layout.num_samples))
    store.mark_complete(0, "score")
    store.create_step(0, layout, policy_version=3, config_hash="other")
    assert store.completed(0) == set() and store.attrs(0)["policy_version"] == 3
    assert np.all(store.read(0, "reward")["reward"] == 0)


def test_mark_complete_keeps_order_free_marks_and_extra_attrs(tmp_path):
    store = make_store(tmp_path)
    assert store.completed(99) == set()
    store.mark_complete(0, "rollout", tokens_per_s=12.5)
    store.mark_complete(0, "rollout")
    store.mark_complete(0, "score")
    assert store.completed(0) == {"rollout", "score"}
    assert store.attrs(0)["complete"] == ["rollout", "score"]
    assert store.attrs(0)["tokens_per_s"] == 12.5


def test_the_marks_lock_files_stay_out_of_the_zarr_hierarchy(tmp_path):
    store = make_store(tmp_path)
    store.mark_complete(0, "rollout")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # Zarr warns about a file in its hierarchy that is no node
        assert sorted(zarr.open_group(store.root, mode="r").group_keys()) == ["step_0"]
    root = Path(store.root)
    assert (root.parent / f".{root.name}.locks" / "step_0.lock").exists()


_NUM_MARKERS = 8


def test_concurrent_marks_from_threads_are_all_kept(tmp_path):
    store = make_store(tmp_path)
    barrier = threading.Barrier(_NUM_MARKERS)
    errors: list[BaseException] = []

    def mark(i: int) -> None:
        try:
            barrier.wait()
            store.mark_complete(0, f"stage{i}")
        except BaseException as exc:  # surfaced below; a thread's exception is otherwise lost
            errors.append(exc)

    threads = [threading.Thread(target=mark, args=(i,)) for i in range(_NUM_MARKERS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert store.completed(0) == {f"stage{i}" for i in range(_NUM_MARKERS)}


def _mark_many(root: str, step: int, prefix: str, count: int, barrier) -> None:
    """Child-process body: many marks, so the two writers' read-modify-writes overlap."""
    store = RolloutStore(root)
    barrier.wait()
    for i in range(count):
        store.mark_complete(step, f"{prefix}{i}")


def test_concurrent_marks_from_processes_are_all_kept(tmp_path):
    store = make_store(tmp_path)
    ctx = multiprocessing.get_context("spawn")
    barrier, count = ctx.Barrier(2), 10
    procs = [ctx.Process(target=_mark_many, args=(store.root, 0, prefix, count, barrier))
             for prefix in ("score", "ref_logp")]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=60)
    assert [p.exitcode for p in procs] == [0, 0]
    assert store.completed(0) == {f"{prefix}{i}" for prefix in ("score", "ref_logp") for i in range(count)}


@pytest.mark.parametrize("name,bad_shape", [("tokens", (18, 5)), ("prompt_ids", (18, 4)),
                                            ("reward", (18, 1)), ("length", (19,))])
def test_wrong_shape_names_the_array_and_changes_nothing(tmp_path, name, bad_shape):
    layout = make_layout()  # 18 samples, prompt_width 5, max_new_tokens 4
    store = make_store(tmp_path, layout=layout)
    before = make_values(name, layout, seed=3)
    store.write(0, name, before)
    with pytest.raises(RolloutStoreError, match=name):
        store.write(0, name, np.full(bad_shape, 7, dtype=ARRAYS[name][0]))
    assert np.array_equal(store.read(0, name)[name], before)


def test_write_rows_checks_every_array_before_writing_any(tmp_path):
    """One call writes a stage's arrays together: a misshapen one is named, and the well-formed
    arrays of the same call are not written either."""
    layout = make_layout()
    store = make_store(tmp_path, layout=layout)
    before = {n: make_values(n, layout, seed=1) for n in ("reward", "tokens")}
    store.write_rows(0, before)
    after = {"reward": make_values("reward", layout, seed=2), "tokens": np.zeros((layout.num_samples, 3), np.int32)}
    with pytest.raises(RolloutStoreError, match="tokens"):
        store.write_rows(0, after)
    with pytest.raises(RolloutStoreError, match="cannot write reward"):  # values that do not cast
        store.write_rows(0, {"tokens": before["tokens"], "reward": np.array(["x"] * layout.num_samples)})
    got = store.read(0, "reward", "tokens")
    assert all(np.array_equal(got[n], before[n]) for n in before)


def test_write_past_the_end_raises_and_changes_nothing(tmp_path):
    layout = make_layout()
    store = make_store(tmp_path, layout=layout)
    before = make_values("advantage", layout)
    store.write(0, "advantage", before)
    with pytest.raises(RolloutStoreError, match="advantage"):
        store.write(0, "advantage", np.ones(layout.chunk_samples, np.float32), start=layout.num_samples - 1)
    assert np.array_equal(store.read(0, "advantage")["advantage"], before)


def test_unknown_array_name_raises(tmp_path):
    store = make_store(tmp_path)
    with pytest.raises(RolloutStoreError, match="'logits'"):
        store.write(0, "logits", np.zeros(18))
    with pytest.raises(RolloutStoreError, match="logits"):
        store.read(0, "logits")


def test_reading_an_unknown_step_raises(tmp_path):
    store = make_store(tmp_path, step=0)
    with pytest.raises(RolloutStoreError, match="step=5"):
        store.read(5, "tokens")
    with pytest.raises(RolloutStoreError, match="step=5"):
        store.attrs(5)
    with pytest.raises(RolloutStoreError, match="step=5"):
        store.write(5, "tokens", np.zeros((18, 4), np.int32))
    empty = RolloutStore(tmp_path / "absent.zarr")
    assert empty.steps() == []
    with pytest.raises(RolloutStoreError):
        empty.read(0, "tokens")


def test_digest_follows_content_not_location(tmp_path):
    layout = make_layout()
    store = make_store(tmp_path / "a", layout=layout)
    twin = make_store(tmp_path / "b", layout=layout)  # the same content in another folder
    assert store.digest(0) == twin.digest(0) and len(store.digest(0)) == 16
    store.write(0, "reward", np.arange(layout.num_samples, dtype=np.float32))
    assert store.digest(0) != twin.digest(0)


def test_marking_an_unknown_step_raises(tmp_path):
    store = make_store(tmp_path, step=0)
    with pytest.raises(RolloutStoreError, match="step=5"):
        store.mark_complete(5, "score")
    assert not store.has_step(5) and store.completed(5) == set()


def test_negative_start_raises(tmp_path):
    store = make_store(tmp_path)
    with pytest.raises(RolloutStoreError, match="reward"):
        store.write(0, "reward", np.ones(3, np.float32), start=-3)


def test_dask_round_trip_and_a_misfit_leaves_the_array_unchanged(tmp_path):
    import dask.array as da

    store = make_store(tmp_path)
    rewards = make_values("reward", make_layout())
    store.write(0, "reward", rewards)
    lazy = store.dask_array(0, "reward")
    assert lazy.chunks[0][0] == store.attrs(0)["chunk_samples"]
    store.write_dask(0, "advantage", lazy * 2)
    np.testing.assert_array_equal(store.read(0, "advantage")["advantage"], rewards * 2)
    with pytest.raises(RolloutStoreError, match="advantage"):
        store.write_dask(0, "advantage", da.zeros(len(rewards) + 1, chunks=8))
    np.testing.assert_array_equal(store.read(0, "advantage")["advantage"], rewards * 2)


def test_cached_handles_follow_a_recreated_step(tmp_path):
    """A step recreated with another layout is written and read at its new shape (no stale handle)."""
    small, big = make_layout(), make_layout(num_prompts=10, groups_per_chunk=5)
    store = make_store(tmp_path, layout=small)
    store.write(0, "reward", make_values("reward", small))
    assert store.read(0, "reward")["reward"].shape == (small.num_samples,)
    store.create_step(0, big, policy_version=3, config_hash="cfg-new")
    values = make_values("reward", big, seed=1)
    store.write(0, "reward", values)
    np.testing.assert_array_equal(store.read(0, "reward")["reward"], values)
    np.testing.assert_array_equal(RolloutStore(store.root).read(0, "length")["length"], 0)  # fresh arrays


def test_a_creation_cut_short_leaves_a_group_that_says_nothing_is_complete(tmp_path, monkeypatch):
    """A process killed while creating a step (the loop creates the next step's group in the
    background) leaves a group whose attributes still give the layout and no complete stage, so a
    rerun recreates it instead of refusing the folder."""
    store, layout = make_store(tmp_path), make_layout()
    from zarr.core.group import AsyncGroup

    async def killed(self, *args, **kwargs):
        raise OSError("killed")

    monkeypatch.setattr(AsyncGroup, "create_array", killed)
    with pytest.raises(RolloutStoreError, match="cannot create step=1"):
        store.create_step(1, layout, policy_version=3, config_hash="h")
    assert store.has_step(1) and store.completed(1) == set()
    assert store.layout(1) == layout and store.attrs(1)["policy_version"] == 3


def test_preflight_passes_over_groups_cut_short(tmp_path):
    from flows.config import load_config
    from flows.iteration import step_layout
    from flows.preflight import _check_steps
    from storage.run_folder import RunFolder

    cfg = load_config("configs/tiny.yaml", [f"runs_dir={tmp_path}"])
    folder = RunFolder.at(tmp_path, cfg.run_name).create()
    store = folder.rollout_store()
    store.create_step(0, step_layout(cfg), policy_version=0, config_hash="h")
    (tmp_path / cfg.run_name / "rollouts.zarr" / "step_1").mkdir()  # killed before its metadata was written
    _check_steps(cfg, folder)
    assert store.completed(1) == set()


def test_a_handle_built_from_a_parsed_document_is_the_one_zarr_opens(tmp_path):
    """A new step's arrays are opened from the metadata parsed for an earlier step's (the same
    zarr.json bytes), not through zarr.open_array: same metadata, config, store and mode."""
    from storage import rollouts

    layout = make_layout()
    store = make_store(tmp_path, step=0, layout=layout)
    store.create_step(1, layout, policy_version=2, config_hash="cfg-abc")
    store.read(0, *ARRAYS)  # parses every document
    opened = []
    real_open = zarr.open_array
    try:
        rollouts.zarr.open_array = lambda *a, **k: opened.append(a) or real_open(*a, **k)
        values = {name: make_values(name, layout, seed=3) for name in ARRAYS}
        store.write_rows(1, values)
        got = store.read(1, *ARRAYS)
    finally:
        rollouts.zarr.open_array = real_open
    assert opened == []  # step 1's handles were built from step 0's parsed metadata
    for name in ARRAYS:
        assert np.array_equal(got[name], values[name]), name
        fast = rollouts._open_array(store.array_path(1, name), "r")
        slow = zarr.open_array(store.array_path(1, name), mode="r")
        assert fast.metadata == slow.metadata and fast.async_array.config == slow.async_array.config, name
        assert fast.store_path.store.root == slow.store_path.store.root and fast.store_path.store.read_only
        assert not rollouts._open_array(store.array_path(1, name), "r+").store_path.store.read_only
        assert np.array_equal(slow[...], values[name]), name  # Zarr reads what the fast handles wrote


def test_attributes_written_without_zarr_are_zarrs_document(tmp_path):
    """mark_complete writes the group's zarr.json itself: Zarr reads back the same attributes
    (NaN included, as its own encoder writes it) and the rest of the document is unchanged."""
    store = make_store(tmp_path)
    path = tmp_path / "rollouts.zarr" / "step_0" / "zarr.json"
    before = zarr.open_group(str(path.parent), mode="r").metadata
    store.mark_complete(0, ("rollout", "reward"), results_reward=[{"reward_mean": float("nan"), "n": 3}], note="x")
    group = zarr.open_group(str(path.parent), mode="r")
    attrs = dict(group.attrs)
    assert attrs["complete"] == ["rollout", "reward"] and attrs["note"] == "x" and attrs["policy_version"] == 2
    assert np.isnan(attrs["results_reward"][0]["reward_mean"]) and attrs["results_reward"][0]["n"] == 3
    ours = store.attrs(0)
    assert ours.keys() == attrs.keys() and np.isnan(ours["results_reward"][0]["reward_mean"])
    assert {k: v for k, v in ours.items() if k != "results_reward"} == {k: v for k, v in attrs.items()
                                                                        if k != "results_reward"}
    assert group.metadata.zarr_format == before.zarr_format and group.metadata.node_type == before.node_type
    zarr.open_group(str(path.parent), mode="r+").attrs.update({"by_zarr": 1})  # and Zarr's own writes still merge
    assert store.attrs(0)["by_zarr"] == 1 and store.attrs(0)["note"] == "x"
    assert not list(path.parent.glob("*.partial"))


def test_verify_finds_a_chunk_deleted_added_or_changed_after_its_stage_completed(tmp_path):
    layout = make_layout()
    store = make_store(tmp_path, layout=layout)
    for name in ("tokens", "length", "reward"):
        store.write(0, name, make_values(name, layout))
    store.mark_complete(0, "rollout")
    store.verify(0)  # nothing changed; reward is written but its stage is not complete: not checked
    store.write(0, "reward", make_values("reward", layout, seed=1))
    store.verify(0)
    tokens = tmp_path / "rollouts.zarr/step_0/tokens"
    chunks = sorted(p for p in tokens.rglob("*") if p.is_file() and p.name != "zarr.json")
    original = chunks[0].read_bytes()
    chunks[0].write_bytes(original[:-1] + bytes([original[-1] ^ 1]))
    with pytest.raises(RolloutStoreError, match=r"step_0/tokens no longer matches .* stage rollout completed: "
                                                r"a file's bytes changed"):
        store.verify(0)
    chunks[0].unlink()
    with pytest.raises(RolloutStoreError, match=rf"1 of its {len(chunks) + 1} files are missing"):
        store.verify(0)
    chunks[0].write_bytes(original)
    store.verify(0)  # the original bytes back: the digest holds again
    (tokens / "c" / "stray").write_bytes(b"x")
    with pytest.raises(RolloutStoreError, match=rf"it holds {len(chunks) + 2} files, {len(chunks) + 1} were written"):
        store.verify(0)
