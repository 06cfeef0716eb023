"""One training step of benchmarks/iteration.py's tiny scenario alone, with no other process running:
the PP 2 1F1B pipeline (two local ranks, one torch thread each, stages/train/local.py) against one
process over the whole batch on two threads and on one thread, as the iteration benchmark's loop
trains.

Per variant ``--reps`` steps after one warm-up; the variants alternate ``--rounds`` times, and the
medians are printed: step seconds (the pipeline's slowest rank), and for the pipeline each rank's
busy seconds in its forward and backward actions (the rest of its step is waits on the other rank).

    PYTHONPATH=$PWD .venv/bin/python benchmarks/train_step.py --reps 6 --rounds 2
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from reference_parallel import _step  # noqa: E402

from stages.policy import build_stage, hf_state, load_hf_state  # noqa: E402
from stages.steps import train_setup  # noqa: E402
from stages.train.engine import TrainSetup  # noqa: E402
from stages.train.local import run_local_pipeline  # noqa: E402
from stages.train.loss import grpo_microbatch_loss  # noqa: E402


def _pipeline(cfg, model_cfg, model, batch, reps: int) -> tuple[list[float], list[float]]:
    """(step seconds, busy seconds of the busier rank) of each measured PP 2 step."""
    setup = TrainSetup(model=model_cfg, pipeline_parallel_size=2, num_microbatches=cfg.num_microbatches,
                       schedule="1f1b", timeout_s=300)
    out = run_local_pipeline(setup, hf_state(model), [batch] * (reps + 1), calls=["train"] * (reps + 1))
    steps = [max(o.steps[c].metrics["step_seconds"] for o in out) for c in range(1, reps + 1)]
    busy = [max(sum(a.seconds for a in o.steps[c].actions if a.kind in ("F", "B")) for o in out)
            for c in range(1, reps + 1)]
    return steps, busy


def _one_process(cfg, model_cfg, model, batch, reps: int, threads: int) -> list[float]:
    """Seconds of each measured step of the whole batch in this process on ``threads`` threads."""
    torch.set_num_threads(threads)
    policy = build_stage(model_cfg)
    load_hf_state(policy, hf_state(model))
    loss_cfg = train_setup(cfg.train, model_cfg, cfg.num_microbatches, cfg.rollout.temperature).loss
    optimizer = torch.optim.AdamW(policy.parameters(), lr=cfg.train.lr)
    out = []
    for _ in range(reps + 1):
        t0 = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        for p in batch.passes:
            loss, _ = grpo_microbatch_loss(policy(p.input_ids, **p.stage_kwargs()), p.target, loss_cfg)
            loss.backward()
        torch.nn.utils.clip_grad_norm_(policy.parameters(), cfg.train.max_grad_norm)
        optimizer.step()
        out.append(time.perf_counter() - t0)
    torch.set_num_threads(1)
    return out[1:]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=6)
    parser.add_argument("--rounds", type=int, default=2, help="alternations of the variants")
    args = parser.parse_args()
    cfg, model_cfg, model, batch = _step("tiny")
    times: dict[str, list[float]] = {"pp2": [], "pp2_busy": [], "two": [], "one": []}
    for _ in range(args.rounds):
        steps, busy = _pipeline(cfg, model_cfg, model, batch, args.reps)
        times["pp2"] += steps
        times["pp2_busy"] += busy
        times["two"] += _one_process(cfg, model_cfg, model, batch, args.reps, 2)
        times["one"] += _one_process(cfg, model_cfg, model, batch, args.reps, 1)
    med = {k: statistics.median(v) for k, v in times.items()}
    print("| PP 2 1F1B step (s) | its busier rank's F + B (s) | one process, 2 threads (s) | one process, 1 thread (s) "
          "| PP 2 / 2 threads | 1 thread / 2 threads |\n| --- | --- | --- | --- | --- | --- |")
    print(f"| {med['pp2']:.3f} | {med['pp2_busy']:.3f} | {med['two']:.3f} | {med['one']:.3f} | "
          f"{med['pp2'] / med['two']:.2f} | {med['one'] / med['two']:.2f} |")


if __name__ == "__main__":
    main()
