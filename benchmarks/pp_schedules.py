"""Pipeline schedules on this machine: measured bubble beside the closed form, and step time.

Two pipeline ranks (local processes, gloo) train the same model on the same global batch with each
schedule of ``train.schedule``, in one run: ``--rounds`` rounds, each running every schedule in turn
for ``--steps`` measured steps (after warm-up), so that load from other work on a shared machine
falls on all schedules alike. Of each schedule's steps the fastest quarter is kept (the least
disturbed), and the table gives:

  measured    bubble fraction per rank, 1 - (time in F/B/I/W) / (step window), averaged over
              ranks and the kept steps (stages/train/timeline.py): it includes the waits on sends
              and receives and framework overhead, which the formulas leave out
  closed      the schedule's paper formula: (p-1)/(m+p-1) for gpipe and 1f1b,
              (p-1)/(v*m+p-1) interleaved; for the zero-bubble schedules
              planner.schedules.estimate_closed_form_bubble with this run's measured F, I, W times
  simulated   planner.simulator over the schedule's own action order with the measured per-stage
              mean F/B/I/W times and free transfers
  F, B        mean forward and backward (B, or I + W) milliseconds of one microbatch over a
              rank's stages
  step        median step seconds of the kept steps (slowest rank), and its ratio to 1F1B's

    .venv/bin/python benchmarks/pp_schedules.py [--microbatches 8] [--rounds 5] [--steps 3] [--threads 1]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections import defaultdict
from dataclasses import asdict, dataclass

import numpy as np
import torch

from planner.schedules import estimate_closed_form_bubble
from planner.simulator import simulate_schedule
from stages.policy import DecoderConfig, build_stage, hf_state
from stages.train.batch import build_global_batch
from stages.train.engine import StepResult, TrainSetup
from stages.layout import SCHEDULES
from stages.train.local import run_local_pipeline
from stages.train.loss import LossConfig

_PP = 2
_VIRTUAL = {"interleaved-1f1b": 2, "zbv": 2, "dualpipev": 2}
_WARMUP_STEPS = 2  # the first step also infers shapes; the second warms allocator and caches
_KEEP = 4  # keep the fastest 1/_KEEP of a schedule's steps: the least disturbed by other work


@dataclass(frozen=True)
class ScheduleRow:
    schedule: str
    virtual: int
    measured_bubble: float
    measured_bubble_per_rank: tuple[float, ...]
    closed_form_bubble: float
    simulated_bubble: float
    step_s: float
    forward_ms: float
    """one microbatch's forward over a rank's stages (mean over ranks)"""
    backward_ms: float
    """its backward: B, or I + W when split"""
    step_ratio_to_1f1b: float = float("nan")


def _model() -> DecoderConfig:
    return DecoderConfig(vocab_size=128, hidden_size=128, intermediate_size=384, num_hidden_layers=8,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=32, bos_token_id=1, eos_token_id=2,
                         pad_token_id=0)


def _batch(cfg: DecoderConfig, num_samples: int, prompt_width: int = 24, max_new: int = 40, seed: int = 0):
    """A synthetic global batch: random prompts and completions of random lengths."""
    rng = np.random.default_rng(seed)
    arrays = dict(
        prompt_ids=rng.integers(3, cfg.vocab_size, (num_samples, prompt_width)).astype(np.int32),
        prompt_len=rng.integers(prompt_width // 2, prompt_width + 1, num_samples).astype(np.int32),
        tokens=rng.integers(3, cfg.vocab_size, (num_samples, max_new)).astype(np.int32),
        length=rng.integers(max_new // 2, max_new + 1, num_samples).astype(np.int32),
        behav_logp=np.full((num_samples, max_new), -np.log(cfg.vocab_size), np.float32),
        ref_logp=np.full((num_samples, max_new), -np.log(cfg.vocab_size), np.float32),
        advantage=rng.normal(size=num_samples).astype(np.float32),
    )
    return build_global_batch(arrays, "token-mean", 0)


def _mean_times(steps: list[list[StepResult]]) -> dict[tuple[int, str], float]:
    """Mean seconds per (virtual stage, kind) over the measured steps of every rank."""
    samples: dict[tuple[int, str], list[float]] = defaultdict(list)
    for rank_steps in steps:
        for step in rank_steps:
            for a in step.actions:
                if a.kind in ("F", "B", "I", "W"):
                    samples[a.stage, a.kind].append(a.seconds)
    return {k: statistics.fmean(v) for k, v in samples.items()}


def _per_rank(means: dict[tuple[int, str], float], kind: str, v: int) -> float:
    """Seconds of ``kind`` for one microbatch over a rank's v stages (mean over stages, times v)."""
    stages = {s for s, _ in means}
    return v * statistics.fmean(means.get((s, kind), 0.0) for s in stages)


def _seconds_per_microbatch(steps: list[list[StepResult]], m: int, kinds: tuple[str, ...]) -> float:
    """Seconds a rank spends in ``kinds`` per microbatch (all its stages), mean over ranks and steps."""
    totals = [sum(a.seconds for a in step.actions if a.kind in kinds) / m for rank in steps for step in rank]
    return statistics.fmean(totals)


def _closed_form(schedule: str, m: int, v: int, means: dict[tuple[int, str], float]) -> float:
    """The paper formula, with per-rank F / I / W seconds from this run where it needs them."""
    f, i, w = (_per_rank(means, k, v) for k in ("F", "I", "W"))
    if i == 0.0:  # a full-backward schedule: I + W = B, split evenly as Qi et al. measure
        i = w = _per_rank(means, "B", v) / 2
    return estimate_closed_form_bubble(schedule, _PP, m, v, f, i, w)


def run_schedule(schedule: str, m: int, steps: int, threads: int, rows_per_microbatch: int) -> list[list[StepResult]]:
    """Measured steps of one schedule, per rank (after the warm-up steps)."""
    cfg = _model()
    model = build_stage(cfg)
    model.init_weights(torch.Generator().manual_seed(0))
    setup = TrainSetup(model=cfg, pipeline_parallel_size=_PP, num_microbatches=m, schedule=schedule,
                       virtual_stages=_VIRTUAL.get(schedule, 1), loss=LossConfig(kl_beta=0.02), timeout_s=300)
    batch = _batch(cfg, m * rows_per_microbatch)
    outputs = run_local_pipeline(setup, hf_state(model), [batch] * (_WARMUP_STEPS + steps),
                                 calls=["grad"] * (_WARMUP_STEPS + steps), num_threads=threads)
    return [out.steps[_WARMUP_STEPS:] for out in outputs]


def summarise(schedule: str, m: int, measured: list[list[StepResult]]) -> ScheduleRow:
    """One table row from every measured step of every rank (see the module docstring)."""
    v = _VIRTUAL.get(schedule, 1)
    n = len(measured[0])
    step_time = [max(rank[i].metrics["step_seconds"] for rank in measured) for i in range(n)]
    kept = sorted(range(n), key=step_time.__getitem__)[:max(1, n // _KEEP)]
    kept_steps = [[rank[i] for i in kept] for rank in measured]
    per_rank = tuple(statistics.fmean(s.metrics["bubble_fraction"] for s in rank) for rank in kept_steps)
    means = _mean_times(kept_steps)
    simulated = simulate_schedule(schedule, _PP, m, v, means, keep_events=False).bubble_fraction
    return ScheduleRow(schedule, v, statistics.fmean(per_rank), per_rank, _closed_form(schedule, m, v, means),
                       simulated, statistics.median(step_time[i] for i in kept),
                       1e3 * _seconds_per_microbatch(kept_steps, m, ("F",)),
                       1e3 * _seconds_per_microbatch(kept_steps, m, ("B", "I", "W")))


def format_table(rows: list[ScheduleRow], m: int) -> str:
    lines = ["| schedule | v | bubble measured (rank 0 / rank 1) | closed form | simulated | F ms | B or I+W ms "
             "| step s | vs 1F1B |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        ranks = " / ".join(f"{b:.3f}" for b in r.measured_bubble_per_rank)
        lines.append(f"| {r.schedule} | {r.virtual} | {r.measured_bubble:.3f} ({ranks}) | {r.closed_form_bubble:.3f} "
                     f"| {r.simulated_bubble:.3f} | {r.forward_ms:.1f} | {r.backward_ms:.1f} | {r.step_s:.3f} "
                     f"| {r.step_ratio_to_1f1b:.2f} |")
    lines.append(f"\np = {_PP} pipeline ranks, m = {m} microbatches per step, v stages per rank; F and B per "
                 "microbatch over one rank's stages.")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--rows", type=int, default=8, help="sequences per microbatch")
    parser.add_argument("--rounds", type=int, default=5, help="rounds over all schedules")
    parser.add_argument("--steps", type=int, default=3, help="measured steps per schedule and round")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    parser.add_argument("--json", default=None, help="also write the rows here")
    args = parser.parse_args()
    t0 = time.perf_counter()
    steps: dict[str, list[list[StepResult]]] = {s: [[] for _ in range(_PP)] for s in SCHEDULES}
    for _ in range(args.rounds):
        for schedule in SCHEDULES:
            for rank, rank_steps in enumerate(run_schedule(schedule, args.microbatches, args.steps, args.threads,
                                                           args.rows)):
                steps[schedule][rank].extend(rank_steps)
    rows = [summarise(s, args.microbatches, steps[s]) for s in SCHEDULES]
    base = next(r.step_s for r in rows if r.schedule == "1f1b")
    rows = [ScheduleRow(**{**asdict(r), "step_ratio_to_1f1b": r.step_s / base}) for r in rows]
    print(format_table(rows, args.microbatches))
    print(f"\n{time.perf_counter() - t0:.0f} s in all")
    if args.json:
        with open(args.json, "w") as f:
            json.dump([asdict(r) for r in rows], f, indent=1)


if __name__ == "__main__":
    main()
