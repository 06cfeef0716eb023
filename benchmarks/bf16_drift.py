"""What bfloat16 costs and buys on the real model: the same SmolLM2 run in float32 and in bfloat16
(rollout.dtype and train.dtype; with --rollout-only rollout.dtype alone, with --train-only train.dtype
alone; AdamW's state and the master weights stay float32), side by side. Below float32 the loss is
decoupled PPO with token-level TIS unless the overrides set train.off_policy (stages/config.py
effective_off_policy), so the float32 run is on-policy and the other weights each token by the mismatch.

Per step and dtype it prints KL(behaviour || trainer) at the step's start (``kl_behav``, the k3
estimate per token), the importance weights' mean and max (``is_weight_*``: the trainer's over the
engine's probability of each sampled token), the clip fraction, the reward, and the seconds of the
rollout and of the training step; then the bfloat16 / float32 ratios of the medians.

    python benchmarks/bf16_drift.py --iterations 3

Needs models/smollm2-135m-instruct (``make model``). Runs go to a temporary folder.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

CONFIG = "configs/smollm2-arithmetic.yaml"
COLUMNS = ("kl_behav", "is_weight_mean", "is_weight_max", "clip_fraction", "reward_mean",
           "rollout_tokens_per_s", "rollout_seconds", "train_step_seconds", "iteration_seconds")


def run(dtype: str, iterations: int, runs_dir: Path, extra: list[str], rollout_only: bool,
        train_only: bool) -> list[dict]:
    train_dtype = "float32" if rollout_only else dtype
    rollout_dtype = "float32" if train_only else dtype
    cmd = [sys.executable, "-m", "flows.cli", "run", CONFIG, f"iterations={iterations}", "eval.path=null",
           f"runs_dir={runs_dir}", f"run_name={dtype}", f"rollout.dtype={rollout_dtype}", f"train.dtype={train_dtype}",
           "--quiet", *extra]
    print("$", " ".join(cmd[2:]), flush=True)
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    return json.loads((runs_dir / dtype / "summary.json").read_text())["metrics"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--iterations", type=int, default=3)
    parser.add_argument("--rollout-only", action="store_true",
                        help="train in float32 in both runs: the engines' bfloat16 drift alone (for a CPU whose "
                             "bfloat16 matmul is slow: the run warns with the measured rates)")
    parser.add_argument("--train-only", action="store_true",
                        help="float32 engines in both runs: training's bfloat16 autocast drift alone")
    parser.add_argument("overrides", nargs="*", help="more overrides for both runs")
    args = parser.parse_args()
    if args.rollout_only and args.train_only:
        parser.error("--rollout-only and --train-only exclude each other (with neither, both run in bfloat16)")
    with tempfile.TemporaryDirectory(prefix="bf16-drift-") as tmp:
        results = {dtype: run(dtype, args.iterations, Path(tmp), args.overrides, args.rollout_only,
                              args.train_only)
                   for dtype in ("float32", "bfloat16")}
    print("\n| step | dtype | " + " | ".join(COLUMNS) + " |")
    print("| --- | --- | " + " | ".join("---" for _ in COLUMNS) + " |")
    for step in range(args.iterations):
        for dtype, rows in results.items():
            print(f"| {step} | {dtype} | " + " | ".join(f"{rows[step].get(c, float('nan')):.4g}" for c in COLUMNS) + " |")
    # Step 0 loads the engines and warms up: the medians start at step 1 where there is one.
    later = slice(1, None) if args.iterations > 1 else slice(None)
    med = {d: {c: statistics.median(r.get(c, float("nan")) for r in rows[later]) for c in COLUMNS}
           for d, rows in results.items()}
    print("\nbfloat16 / float32, medians of steps", "1.." if args.iterations > 1 else "0", ":")
    for c in ("rollout_tokens_per_s", "rollout_seconds", "train_step_seconds", "iteration_seconds"):
        print(f"  {c}: {med['bfloat16'][c] / med['float32'][c]:.3f}")
    print(f"  kl_behav: bfloat16 {med['bfloat16']['kl_behav']:.3g}, float32 {med['float32']['kl_behav']:.3g}")


if __name__ == "__main__":
    main()
