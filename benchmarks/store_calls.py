"""What one call into the rollout store costs a task: RolloutStore (storage/rollouts.py) against the same
operations through Zarr's own API, side by side on a tiny-config step (64 prompts x G 8, a chunk
per engine).

Every step is a new Zarr group, so each task opens that step's arrays for the first time: Zarr's
``open_array`` reads and parses the array's zarr.json through its event loop, where the store builds
the handle from the metadata it parsed for an earlier step's array of the same name (the same
document). Attributes are the group's zarr.json, read and written as that JSON document.

    PYTHONPATH=$PWD .venv/bin/python benchmarks/store_calls.py --steps 30

Prints the median milliseconds of each call, the store's and Zarr's, and their ratio.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time

import numpy as np
import zarr
from zarr.core.sync import sync

from storage.rollouts import ARRAYS, RolloutStore, StepLayout

# The rollout task's arrays (with reward.in_rollout: its scores too) and the train task's read.
ROLLOUT_WRITE = ("prompt_ids", "prompt_len", "tokens", "length", "behav_logp", "finish_reason", "group_id",
                 "policy_version", "reward", "reward_failed", "advantage")
TRAIN_READ = ("prompt_ids", "prompt_len", "tokens", "length", "behav_logp", "advantage", "reward_failed")


def _rows(layout: StepLayout, names: tuple[str, ...], rows: int) -> dict[str, np.ndarray]:
    tail = {"": (), "prompt": (layout.prompt_width,), "gen": (layout.max_new_tokens,)}
    return {n: np.ones((rows, *tail[ARRAYS[n][1]]), dtype=ARRAYS[n][0]) for n in names}


def _zarr_write(store: RolloutStore, step: int, arrays: dict[str, np.ndarray]) -> None:
    """The same write through zarr.open_array handles, in one call into Zarr's event loop."""
    handles = [(zarr.open_array(store.array_path(step, n), mode="r+"), v) for n, v in arrays.items()]

    async def write_all():
        await asyncio.gather(*(a.async_array.setitem(slice(0, len(v)), v) for a, v in handles))

    sync(write_all())


def _zarr_read(store: RolloutStore, step: int, names: tuple[str, ...]) -> None:
    handles = [zarr.open_array(store.array_path(step, n), mode="r") for n in names]

    async def read_all():
        return await asyncio.gather(*(a.async_array.getitem(slice(None)) for a in handles))

    sync(read_all())


def _zarr_mark(store: RolloutStore, step: int) -> None:
    group = zarr.open_group(store.ref(step).path, mode="r+")
    group.attrs.update({"complete": [*group.attrs.get("complete", []), "x"]})


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=30, help="step groups per variant (a new group per call)")
    args = p.parse_args()
    layout = StepLayout(64, 8, 7, 6, groups_per_chunk=32)
    rows = layout.chunk_samples
    write, n = _rows(layout, ROLLOUT_WRITE, rows), args.steps
    calls = {  # name -> (store's call, Zarr's call), each on a fresh step
        "write 11 arrays (a rollout task's)": (lambda st, k: st.write_rows(k, write),
                                              lambda st, k: _zarr_write(st, k, write)),
        "read 7 arrays (a train task's)": (lambda st, k: st.read(k, *TRAIN_READ),
                                           lambda st, k: _zarr_read(st, k, TRAIN_READ)),
        "read the step's attributes": (lambda st, k: st.attrs(k),
                                       lambda st, k: dict(zarr.open_group(st.ref(k).path, mode="r").attrs)),
        "mark a stage complete": (lambda st, k: st.mark_complete(k, "x"), lambda st, k: _zarr_mark(st, k)),
    }
    with tempfile.TemporaryDirectory() as tmp:
        store = RolloutStore(f"{tmp}/rollouts.zarr")
        for k in range(2 * n):
            store.create_step(k, layout, 0, "bench")
        store.read(2 * n - 1, *ARRAYS)  # the metadata documents, parsed once as in a running task
        print(f"| call | RolloutStore (ms) | zarr's API (ms) | ratio |\n| --- | --- | --- | --- |")
        for name, (ours, theirs) in calls.items():
            times: dict[str, list[float]] = {"ours": [], "theirs": []}
            for k in range(n):  # interleaved, each on a step neither has opened
                for which, fn, step in (("ours", ours, k), ("theirs", theirs, n + k)):
                    t0 = time.perf_counter()
                    fn(store, step)
                    times[which].append(time.perf_counter() - t0)
            a, b = (statistics.median(times[w]) * 1e3 for w in ("ours", "theirs"))
            print(f"| {name} | {a:.2f} | {b:.2f} | {a / b:.2f} |")


if __name__ == "__main__":
    main()
