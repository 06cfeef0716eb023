"""Asynchronous GRPO against the synchronous loop on a fixed core budget (not a test).

Four runs of the same tiny addition config (pp = 1: one training rank, one rollout engine):

  colocated s=0   one worker does both phases with 2 torch threads (the reference)
  decoupled s=0   rollout engine 1 thread, training rank 1 thread, the synchronous loop
  decoupled s=1   the same pools, step k generates from max(0, k - 1) while the rank trains k
  decoupled s=2

By default generation and training take comparable time: 16 prompts x G 8 from the untrained
policy v0 (warmup.steps=0: end-of-sequence is one token in ~17, so completions run long) with up to
32 new tokens. Its reward stays 0 (exact match of an untrained model): for the reward curve run
``--warmed --prompts 32 --max-new-tokens 6`` (the shipped tiny policy, whose answers end after 2-4
tokens, so generation is a third of training there).

Per run: seconds per step in the steady state (the median step window after the first two steps),
samples per second, the idle fractions of the rollout pool and of the training rank (from the
tasks' own timestamps, flows/loop.py), CPU seconds per step of all the run's processes, and reward
against wall-clock seconds. The planner (planner/async_steptime.py) takes the decoupled sync run's
median stage seconds, its training ranks' hand-off and its host CPU per step, and predicts every
decoupled run's step time; printed beside the measurement, with the pure-overlap prediction (no
host terms) for comparison. A PNG of reward against wall-clock seconds goes to ``--out``.

    PYTHONPATH=$PWD .venv/bin/python benchmarks/async.py [--iterations 10] [--prompts 16] [--max-new-tokens 32]
        [--warmed] [--runs-dir DIR] [key=value ...]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import tempfile
from pathlib import Path

from flows.config import load_config
from flows.loop import run
from planner.async_steptime import StageSeconds, async_step_seconds, sync_step_seconds
from stages.config import effective_off_policy

_RUNS = (("colocated s=0", "colocated", 0, 2), ("decoupled s=0", "decoupled", 0, 1),
         ("decoupled s=1", "decoupled", 1, 1), ("decoupled s=2", "decoupled", 2, 1))


def _config(runs_dir: str, name: str, placement: str, s: int, threads: int, args: argparse.Namespace):
    return load_config("configs/tiny.yaml", [
        f"run_name={name}", f"runs_dir={runs_dir}", f"iterations={args.iterations}",
        f"rollout.max_staleness={s}", f"cluster.placement={placement}", f"cluster.rollout_threads={threads}",
        f"cluster.train_threads={threads}", "train.pipeline_model_parallel_size=1",
        f"task.prompts_per_step={args.prompts}", f"rollout.max_new_tokens={args.max_new_tokens}",
        f"train.micro_batch_size={args.prompts * 8 // 4}", "reward.num_tasks=1", "rollout.num_engines=1",
        # The graph of docs/performance.md's figures: a stage a task (the overrides may change it;
        # the planner's terms follow the config).
        "reward.in_rollout=false", "train.reference_pass=separate",
        *(() if args.warmed else ("warmup.steps=0",)), *args.overrides])


def _median(metrics: list[dict], key: str, skip: int = 2) -> float:
    values = [m[key] for m in metrics[skip:] if key in m] or [m[key] for m in metrics if key in m]
    return statistics.median(values)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--iterations", type=int, default=10)
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--warmed", action="store_true", help="start from the warmed-up tiny policy (configs/tiny.yaml's "
                    "warm-up) instead of the untrained one")
    ap.add_argument("--out", default="docs/async_reward_vs_time.png")
    ap.add_argument("--json", default="")
    ap.add_argument("--runs-dir", default="", help="reuse this folder's base-policy cache (default: a temp folder)")
    ap.add_argument("overrides", nargs="*", help="key=value on top of the benchmark config, e.g. rollout.temperature=0.7")
    args = ap.parse_args()
    runs_dir = args.runs_dir or tempfile.mkdtemp(prefix="async-bench-")
    rows = []
    for label, placement, s, threads in _RUNS:
        cfg = _config(runs_dir, label.replace(" ", "-").replace("=", ""), placement, s, threads, args)
        summary = run(cfg, progress=False)
        m = summary.metrics
        step_s = _median(m, "step_window_seconds")
        window = sum(x.get("step_window_seconds", 0.0) for x in m[2:])
        idle = {p: sum(x.get(f"{p}_idle_seconds", 0.0) for x in m[2:]) / max(window, 1e-9) for p in ("rollout", "train")}
        t, clock = 0.0, []
        for x in m:
            t += x.get("step_window_seconds", 0.0)
            clock.append(t)
        rows.append({"label": label, "placement": placement, "s": s, "step_s": step_s,
                     "host_cpu_s": _median(m, "host_cpu_seconds"), "handoff_s": _median(m, "train_handoff_seconds"),
                     "samples_per_s": cfg.num_samples / step_s, "idle": idle, "clock": clock,
                     "reward": summary.reward_mean, "wall_s": summary.wall_seconds,
                     "stages": {k: _median(m, f"{k}_seconds") for k in
                                ("rollout", "reward", "reference", "advantage", "train", "publish")}})
    sync = next(r for r in rows if r["label"] == "decoupled s=0")
    st = sync["stages"]
    # Where the config runs the scoring and the reference pass (the stages' seconds are their own).
    graph = dict(reward_in_rollout=cfg.reward.in_rollout, reference_in_train=cfg.train.reference_pass == "fused")
    critical = StageSeconds(**st, **graph)
    loop = max(0.0, sync["step_s"] - sync_step_seconds(critical))
    # pi_prox is the train forward's own log-prob unless a proximal pass is configured (P = 0 then).
    passes = effective_off_policy(cfg.train, 1).proximal == "pass"
    overlap = StageSeconds(**st, **graph, loop=loop, proximal=None if passes else 0.0)
    # The host's terms, from the same sync run: hand-off hops on the training chain, CPU per step.
    cores = len(os.sched_getaffinity(0))
    calibrated = dataclasses.replace(overlap, handoff=sync["handoff_s"], host_cpu=sync["host_cpu_s"], cores=cores)
    print(f"sync stage seconds (median): " + ", ".join(f"{k} {v:.3f}" for k, v in st.items()) +
          f", loop {loop:.3f}, hand-off {sync['handoff_s']:.3f}, host CPU {sync['host_cpu_s']:.3f} s "
          f"on {cores} cores")
    print(f"{'run':<15} {'s/step':>7} {'pred':>7} {'err':>6} {'overlap':>7} {'err':>6} {'host cpu':>8} "
          f"{'samples/s':>9} {'x sync':>6} {'idle roll':>9} {'idle train':>10} {'reward first->last':>19}")
    for r in rows:
        colocated = r["placement"] == "colocated"
        pred = async_step_seconds(calibrated, r["s"], colocated=colocated)
        bare = async_step_seconds(overlap, r["s"], colocated=colocated)
        r["predicted_s"], r["overlap_s"] = pred, bare
        pred_txt = (f"{pred:>7.3f} {pred / r['step_s'] - 1:>+6.0%} {bare:>7.3f} {bare / r['step_s'] - 1:>+6.0%}"
                    if not colocated else f"{'':>7} {'':>6} {'':>7} {'':>6}")
        pred_txt += f" {r['host_cpu_s']:>8.3f}"
        w = max(1, len(r["reward"]) // 4)
        first, last = sum(r["reward"][:w]) / w, sum(r["reward"][-w:]) / w
        print(f"{r['label']:<15} {r['step_s']:>7.3f} {pred_txt} {r['samples_per_s']:>9.1f} "
              f"{sync['step_s'] / r['step_s']:>6.2f} {r['idle']['rollout']:>9.0%} {r['idle']['train']:>10.0%} "
              f"{first:>9.3f} -> {last:.3f}")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for r in rows:
        ax.plot(r["clock"], r["reward"], marker=".", label=r["label"])
    ax.set_xlabel("wall-clock seconds (from the first task)")
    ax.set_ylabel("mean reward of the step")
    ax.set_title(f"tiny addition, {args.prompts} prompts x 8, <= {args.max_new_tokens} new tokens, "
                 f"{'warmed' if args.warmed else 'untrained'} v0, 2 cores")
    ax.legend()
    fig.tight_layout()
    fig.savefig(args.out, dpi=110)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
