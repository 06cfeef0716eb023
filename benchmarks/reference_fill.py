"""The reference pass inside the training step's waits (train.reference_fill=auto) against the
whole pass before the step (=false), side by side in one process: whole ``grpoflow run``s of a
scenario of benchmarks/iteration.py with the fused reference pass (train.reference_pass=fused),
the variants alternating, ``--reps`` runs of each.

Per run, the median over steps 2.. (steps 0 and 1 plan from nothing: the first step's waits
hold torch's shape inference) of the step window, the train stage and the reference
microbatches filled per step; then the medians over the runs and the ratio auto / false.

    PYTHONPATH=$PWD .venv/bin/python benchmarks/reference_fill.py --scenario tiny --reps 3 --iterations 10

``--engine``: the train task's call alone (TrainRank.train_step_with_reference on two local
ranks, 1F1B, the shapes of benchmarks/reference_parallel.py), ``--iterations`` calls per run;
per call the slower rank's wall time and the microbatches filled, and with auto the longest wait
any rank offered and the time of one reference microbatch, medians of calls 2.. .

    PYTHONPATH=$PWD .venv/bin/python benchmarks/reference_fill.py --engine --scenario bench --reps 3 --iterations 6
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from iteration import SCENARIOS, grpoflow_iterations, scenario_config  # noqa: E402

_KEYS = ("step_window_seconds", "train_seconds", "train_step_seconds", "reference_compute_seconds",
         "reference_fill_microbatches", "bubble_fraction")


def _run(scenario: str, fill: str, iterations: int, runs_dir: str, name: str, extra: list[str]) -> dict[str, float]:
    cfg = scenario_config(scenario, runs_dir, name, iterations,
                          ["train.reference_pass=fused", f"train.reference_fill={fill}", *extra])
    steps = grpoflow_iterations(cfg)[2:]
    return {k: statistics.median(m.get(k, 0.0) for m in steps) for k in _KEYS}


def _engine(scenario: str, fill: bool, calls: int) -> dict[str, float]:
    from reference_parallel import _step

    from stages.policy import hf_state
    from stages.train.engine import TrainSetup
    from stages.train.local import run_local_pipeline
    from stages.train.loss import LossConfig

    cfg, model_cfg, model, batch = _step(scenario)
    setup = TrainSetup(model=model_cfg, pipeline_parallel_size=2, num_microbatches=cfg.num_microbatches,
                       schedule="1f1b", timeout_s=600, reference_parallel="data", reference_fill=fill,
                       loss=LossConfig(kl_beta=cfg.train.kl_beta))
    out = run_local_pipeline(setup, hf_state(model), [batch] * calls, calls=["train_with_reference"] * calls)
    def med(per_call) -> float:
        return statistics.median(per_call(c) for c in range(2, calls))

    row = {"call_seconds": med(lambda c: max(o.seconds[c] for o in out)),
           "reference_fill_microbatches": med(lambda c: sum(o.steps[c].metrics.get("reference_fill_microbatches", 0.0)
                                                            for o in out))}
    if fill:  # what the plan went on: the longest offered wait of any rank, and one microbatch's time
        for key in ("reference_fill_wait_seconds", "reference_microbatch_seconds"):
            row[key] = med(lambda c: max(o.steps[c].metrics[key] for o in out))
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--scenario", choices=sorted(SCENARIOS), default="tiny")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--iterations", type=int, default=10)
    parser.add_argument("--engine", action="store_true", help="the train task's call alone (module docstring)")
    parser.add_argument("overrides", nargs="*", help="config overrides for both variants (whole runs)")
    args = parser.parse_args()
    if args.iterations < 3:
        parser.error("--iterations must be >= 3: steps 0 and 1 plan nothing")
    rows: dict[str, list[dict[str, float]]] = {"false": [], "auto": []}
    with tempfile.TemporaryDirectory() as runs_dir:
        for rep in range(args.reps):
            for fill in ("false", "auto"):
                if args.engine:
                    row = _engine(args.scenario, fill == "auto", args.iterations)
                else:
                    row = _run(args.scenario, fill, args.iterations, runs_dir, f"{fill}-{rep}", args.overrides)
                rows[fill].append(row)
                print(f"rep {rep} {fill:>5}: " + " ".join(f"{k} {v:.4f}" for k, v in row.items()), flush=True)
    keys = list(rows["auto"][0])
    med = {fill: {k: statistics.median(r[k] for r in rs) for k in keys if k in rs[0]} for fill, rs in rows.items()}
    what = "calls" if args.engine else "iterations"
    print(f"\n{args.scenario}, {args.reps} runs x {args.iterations} {what} each, medians of 2..:")
    for k in keys:
        off, auto = med["false"].get(k, 0.0), med["auto"][k]
        ratio = f"{auto / off:.3f}" if off else "-"
        print(f"  {k:<28} false {off:9.4f}   auto {auto:9.4f}   auto/false {ratio}")

if __name__ == "__main__":
    main()
