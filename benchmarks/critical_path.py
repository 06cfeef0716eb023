"""Where each step of a finished run spent its window, read from its run folder: the start and end
of every task and the tasks' own measurements, stored with the stage marks (flows/tasks.py), so a
run needs no second pass or tracing to be broken down.

A step's window runs from the previous step's last training task end to its own, as
``step_window_seconds`` in summary.json and benchmarks/iteration.py. Six consecutive parts tile
it exactly:

    hop to publish      previous step's last train task end -> its publish task start
    publish             the publish task (marks, version manifest)
    hop to rollout      publish end -> the first rollout task start
    rollout             first rollout task start -> last rollout task end
    rollout to train    last rollout end -> first train task start (the hop; with separate
                        reference or scoring stages, their tasks too)
    train               first train task start -> last train task end

and the rollout and train parts are split further on the task that ended last (the one the window
waited for): its start after the first one, then its own measured phases. Steps whose rollout starts
before the previous step's training ends (``rollout.max_staleness`` >= 1) overlap and have no such
path; they are counted and left out. A publish task's times are stored since the mark recorded
them; for older runs the publish part and its two hops are one part. In a resumed run the first
step after the restart spans it (its previous step ended in the earlier process): use ``--skip``.

    PYTHONPATH=$PWD .venv/bin/python benchmarks/critical_path.py RUNS_DIR/RUN_NAME
    PYTHONPATH=$PWD .venv/bin/python benchmarks/critical_path.py RUNS_DIR/RUN_NAME --skip 2 --steps
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from storage.rollouts import RolloutStore  # noqa: E402

__all__ = ["PARTS", "TILES", "step_parts", "run_parts", "medians"]

# (key, label, indent): the order printed; an indented part is one of the part above it.
PARTS = (
    ("hop_publish", "hop: train -> publish", 0),
    ("publish", "publish task", 0),
    ("hop_rollout", "hop: publish -> rollout", 0),
    ("publish_and_hops", "publish and its hops (run stored without publish times)", 0),
    ("rollout", "rollout tasks", 0),
    ("rollout_skew", "last engine's start after the first", 1),
    ("weight_load", "weight load", 1),
    ("generate", "generate", 1),
    ("score", "score and normalise", 1),
    ("rollout_other", "prompts, step attributes, row writes", 1),
    ("rollout_to_train", "rollout -> train (hop, separate stages)", 0),
    ("train", "train tasks", 0),
    ("train_skew", "last rank's start after the first", 1),
    ("before_schedule", "read, build, waits", 1),
    ("reference", "reference pass", 1),
    ("schedule", "pipeline schedule", 1),
    ("after_schedule", "grad reduce, clip, AdamW, writes", 1),
)
TILES = ("hop_publish", "publish", "hop_rollout", "publish_and_hops", "rollout", "rollout_to_train", "train")


def _last(results: list[dict]) -> dict:
    return max(results, key=lambda r: r["task_end"])


def step_parts(previous: dict, attrs: dict) -> dict[str, float] | None:
    """The parts (seconds) of the window of the step whose step-group attributes are ``attrs``,
    ``previous`` the previous step's; None when the two steps overlap or a step stored no task
    times for a stage. ``window`` is their sum."""
    trains, rollouts = attrs.get("results_train"), attrs.get("results_rollout")
    before = previous.get("results_train")
    if not (trains and rollouts and before):
        return None
    t0 = max(r["task_end"] for r in before)
    r0, r1 = min(r["task_start"] for r in rollouts), max(r["task_end"] for r in rollouts)
    s0, t1 = min(r["task_start"] for r in trains), max(r["task_end"] for r in trains)
    if not t0 <= r0 <= r1 <= s0 <= t1:
        return None
    parts: dict[str, float] = {}
    published = [r for r in previous.get("results_publish", []) if "task_start" in r]
    if published:
        p0, p1 = published[0]["task_start"], published[0]["task_end"]
        if not t0 <= p0 <= p1 <= r0:
            return None
        parts.update(hop_publish=p0 - t0, publish=p1 - p0, hop_rollout=r0 - p1)
    else:
        parts["publish_and_hops"] = r0 - t0
    parts.update(rollout=r1 - r0, rollout_to_train=s0 - r1, train=t1 - s0)

    engine = _last(rollouts)
    phases = {"weight_load": engine.get("weight_load_seconds", 0.0), "generate": engine["rollout_seconds"],
              "score": engine.get("reward_seconds", 0.0)}
    parts["rollout_skew"] = engine["task_start"] - r0
    parts.update(phases)
    parts["rollout_other"] = engine["task_end"] - engine["task_start"] - sum(phases.values())

    rank = _last(trains)
    start_ns, end_ns = rank["window_ns"]
    reference = rank.get("reference_seconds", 0.0)  # train.reference_pass = fused: before the schedule
    parts["train_skew"] = rank["task_start"] - s0
    parts["before_schedule"] = start_ns / 1e9 - rank["task_start"] - reference
    parts["reference"] = reference
    parts["schedule"] = (end_ns - start_ns) / 1e9
    parts["after_schedule"] = rank["task_end"] - end_ns / 1e9
    parts["window"] = t1 - t0
    return parts


def run_parts(run_dir: str | Path, skip: int = 1) -> tuple[dict[int, dict[str, float]], list[int]]:
    """({step: parts}, the steps with no single path (:func:`step_parts` gave None)) of a run
    folder's steps from ``skip`` on (step 0 has no window; the first windows hold start-up)."""
    store = RolloutStore(Path(run_dir) / "rollouts.zarr")
    steps = [s for s in store.steps() if "train" in store.completed(s)]
    out, overlapping = {}, []
    for prev, step in zip(steps, steps[1:]):
        if step != prev + 1 or step < max(skip, 1):
            continue
        parts = step_parts(store.attrs(prev), store.attrs(step))
        if parts is None:
            overlapping.append(step)
        else:
            out[step] = parts
    return out, overlapping


def medians(by_step: dict[int, dict[str, float]]) -> dict[str, float]:
    """Each part's median over the steps that have it (``window`` included)."""
    keys = {k for parts in by_step.values() for k in parts}
    return {k: statistics.median(p[k] for p in by_step.values() if k in p) for k in keys}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("run_dir", help="a run folder (RUNS_DIR/RUN_NAME)")
    p.add_argument("--skip", type=int, default=1, help="steps left out at the start (default 1: step 0 has no window)")
    p.add_argument("--steps", action="store_true", help="also print every step's parts")
    args = p.parse_args()
    if not (Path(args.run_dir) / "rollouts.zarr").is_dir():
        p.error(f"{args.run_dir}: not a run folder (no rollouts.zarr)")
    by_step, overlapping = run_parts(args.run_dir, args.skip)
    if overlapping:
        print(f"{len(overlapping)} steps have no single path (their tasks overlap the step before: "
              f"rollout.max_staleness >= 1, or a step rerun; or they stored no task times): left out "
              f"({', '.join(map(str, overlapping[:10]))}{' ...' if len(overlapping) > 10 else ''})")
    if not by_step:
        sys.exit(f"{args.run_dir}: no step to break down")
    med = medians(by_step)
    keys = [k for k, _, _ in PARTS if k in med]
    labels = {k: ("&nbsp;&nbsp;" * indent) + label for k, label, indent in PARTS}
    print(f"{args.run_dir}: steps {min(by_step)}-{max(by_step)} ({len(by_step)}), medians in ms "
          f"(min - max); the unindented parts tile the window\n")
    print("| part | ms | min - max |\n| --- | --- | --- |")
    for k in keys:
        values = [s[k] for s in by_step.values() if k in s]
        print(f"| {labels[k]} | {med[k] * 1e3:.1f} | {min(values) * 1e3:.1f} - {max(values) * 1e3:.1f} |")
    windows = [s["window"] for s in by_step.values()]
    print(f"| **window** | **{med['window'] * 1e3:.1f}** | {min(windows) * 1e3:.1f} - {max(windows) * 1e3:.1f} |")
    print(f"\nsum of the tiles' medians {sum(med[k] for k in keys if k in TILES) * 1e3:.1f} ms "
          "(medians need not add up to the median window)")
    if args.steps:
        print("\n| step | " + " | ".join(k for k in keys) + " | window |\n|" + " --- |" * (len(keys) + 2))
        for step, s in by_step.items():
            print(f"| {step} | " + " | ".join(f"{s[k] * 1e3:.1f}" if k in s else "" for k in keys)
                  + f" | {s['window'] * 1e3:.1f} |")


if __name__ == "__main__":
    main()
