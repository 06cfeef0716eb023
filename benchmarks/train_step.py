"""One training step of benchmarks/iteration.py's tiny scenario alone, with no other process running:
the PP 2 pipeline (two local ranks, one torch thread each, stages/train/local.py; 1F1B, or each of
``--schedules``) against one process over the whole batch on two threads and on one thread, as the
iteration benchmark's loop trains.

Per variant ``--reps`` steps after one warm-up; the variants alternate ``--rounds`` times, and the
medians are printed: step seconds (the pipeline's slowest rank), and for the pipeline each rank's
busy seconds in its compute actions (forward, backward, and a split backward's input and weight
parts; the rest of its step is waits on the other rank).

    PYTHONPATH=$PWD .venv/bin/python benchmarks/train_step.py --reps 6 --rounds 2
    PYTHONPATH=$PWD .venv/bin/python benchmarks/train_step.py --reps 6 --rounds 2 --schedules 1f1b zb-h1 zbv:2
    PYTHONPATH=$PWD .venv/bin/python benchmarks/train_step.py --reps 6 --rounds 2 train.micro_batch_size=128
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
from stages.train.setup import train_setup  # noqa: E402
from stages.train.engine import TrainSetup  # noqa: E402
from stages.layout import schedule_error  # noqa: E402
from stages.train.local import run_local_pipeline  # noqa: E402
from stages.train.loss import grpo_microbatch_loss  # noqa: E402
from stages.train.timeline import COMPUTE_KINDS  # noqa: E402


def _pipeline(cfg, model_cfg, model, batch, reps: int, schedule: str = "1f1b",
              virtual: int = 1) -> tuple[list[float], list[float]]:
    """(step seconds, busy seconds of the busier rank) of each measured PP 2 step."""
    setup = TrainSetup(model=model_cfg, pipeline_parallel_size=2, num_microbatches=cfg.num_microbatches,
                       schedule=schedule, virtual_stages=virtual, timeout_s=300)
    out = run_local_pipeline(setup, hf_state(model), [batch] * (reps + 1), calls=["train"] * (reps + 1))
    steps = [max(o.steps[c].metrics["step_seconds"] for o in out) for c in range(1, reps + 1)]
    busy = [max(sum(a.seconds for a in o.steps[c].actions if a.kind in COMPUTE_KINDS) for o in out)
            for c in range(1, reps + 1)]
    return steps, busy


def _one_process(cfg, model_cfg, model, batch, reps: int, threads: int) -> list[float]:
    """Seconds of each measured step of the whole batch in this process on ``threads`` threads."""
    torch.set_num_threads(threads)
    policy = build_stage(model_cfg)
    load_hf_state(policy, hf_state(model))
    loss_cfg = train_setup(cfg.train, model_cfg, cfg.num_microbatches, cfg.rollout.temperature).loss
    optimizer = torch.optim.AdamW(policy.parameters(), lr=cfg.lr)
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
    parser.add_argument("--scenario", choices=("tiny", "bench"), default="tiny",
                        help="benchmarks/iteration.py's scenario (bench: its model, synthetic log-normal lengths)")
    parser.add_argument("--reps", type=int, default=6)
    parser.add_argument("--rounds", type=int, default=2, help="alternations of the variants")
    parser.add_argument("--schedules", nargs="+", default=["1f1b"], metavar="NAME[:V]",
                        help="pipeline schedules to time, each with its stages per rank (default 1)")
    parser.add_argument("overrides", nargs="*", help="key=value on top of the scenario "
                        "(e.g. train.micro_batch_size=128)")
    args = parser.parse_args()
    cfg, model_cfg, model, batch = _step(args.scenario, args.overrides)
    pipes = [(name, int(v or 1)) for name, _, v in (s.partition(":") for s in args.schedules)]
    for name, v in pipes:
        problem = schedule_error(name, 2, cfg.num_microbatches, v, model_cfg.num_hidden_layers)
        if problem:
            parser.error(problem)
    steps: dict[tuple[str, int], list[float]] = {p: [] for p in pipes}
    busy: dict[tuple[str, int], list[float]] = {p: [] for p in pipes}
    one_process: dict[int, list[float]] = {2: [], 1: []}  # threads -> step seconds
    for _ in range(args.rounds):
        for name, v in pipes:
            s, b = _pipeline(cfg, model_cfg, model, batch, args.reps, name, v)
            steps[name, v] += s
            busy[name, v] += b
        for threads, times in one_process.items():
            times += _one_process(cfg, model_cfg, model, batch, args.reps, threads)
    two, one = (statistics.median(one_process[t]) for t in (2, 1))
    print(f"one process over the whole batch: 2 threads {two:.3f} s, 1 thread {one:.3f} s "
          f"(1 thread / 2 threads {one / two:.2f})\n")
    print("| PP 2 schedule | stages per rank | step (s) | its busier rank's compute (s) | step / one process, 2 threads |\n"
          "| --- | --- | --- | --- | --- |")
    for name, v in pipes:
        step = statistics.median(steps[name, v])
        print(f"| {name} | {v} | {step:.3f} | {statistics.median(busy[name, v]):.3f} | {step / two:.2f} |")


if __name__ == "__main__":
    main()
