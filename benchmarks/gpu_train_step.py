"""One training rank's step (PP 1, 1F1B over 4 microbatches, AdamW) on a GPU in float32 and under
bfloat16 autocast, beside the same step on this machine's CPU: the training half of a GRPO
iteration on CUDA, with nothing but torch and the stages (a GPU machine without the flows'
packages runs it; benchmarks/gpu.sh does).

Shapes: the tiny config's step (hidden 64, 4 layers, 512 completions of 7 + 6 tokens) and the
iteration benchmark's bench shape (hidden 512, 8 layers, 8 heads / 4 KV heads, MLP 1376, 128
completions of 7 + 64 tokens), random weights and tokens, completion lengths uniform in
[1, max_new]. Median step seconds over ``--reps`` steps after one warm-up, and real (completion)
tokens per second.

    python3 benchmarks/gpu_train_step.py --reps 5             # on a GPU machine
    PYTHONPATH=$PWD .venv/bin/python benchmarks/gpu_train_step.py --devices cpu --reps 2
"""

from __future__ import annotations

import argparse
import statistics

import numpy as np
import torch

from stages.policy import DecoderConfig, build_stage, hf_state
from stages.train.batch import build_global_batch
from stages.train.engine import TrainSetup
from stages.train.local import run_local_pipeline

SHAPES = {
    "tiny": (DecoderConfig(vocab_size=32, hidden_size=64, intermediate_size=176, num_hidden_layers=4,
                           num_attention_heads=4, num_key_value_heads=2, head_dim=16), 512, 7, 6),
    "bench": (DecoderConfig(vocab_size=2560, hidden_size=512, intermediate_size=1376, num_hidden_layers=8,
                            num_attention_heads=8, num_key_value_heads=4, head_dim=64), 128, 7, 64),
}


def _batch(cfg: DecoderConfig, rows: int, prompt: int, new: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    arrays = dict(
        prompt_ids=rng.integers(1, cfg.vocab_size, (rows, prompt)).astype(np.int32),
        prompt_len=np.full(rows, prompt, np.int32),
        tokens=rng.integers(1, cfg.vocab_size, (rows, new)).astype(np.int32),
        length=rng.integers(1, new + 1, rows).astype(np.int32),
        behav_logp=np.full((rows, new), -np.log(cfg.vocab_size), np.float32),
        ref_logp=np.full((rows, new), -np.log(cfg.vocab_size), np.float32),
        advantage=rng.normal(size=rows).astype(np.float32),
    )
    return build_global_batch(arrays, "token-mean", 0), int(arrays["length"].sum())


def _time(cfg: DecoderConfig, batch, device: str, dtype: str, reps: int, threads: int) -> float:
    model = build_stage(cfg)
    model.init_weights(torch.Generator().manual_seed(0), std=0.02)
    setup = TrainSetup(model=cfg, pipeline_parallel_size=1, num_microbatches=4, device=device, dtype=dtype,
                       timeout_s=300)
    (out,) = run_local_pipeline(setup, hf_state(model), [batch] * (reps + 1), calls=["train"] * (reps + 1),
                                num_threads=threads)
    if any(out.errors):
        raise RuntimeError(next(e for e in out.errors if e))
    return statistics.median(out.steps[c].metrics["step_seconds"] for c in range(1, reps + 1))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--devices", default="cuda,cpu", help="comma-separated: cuda, cpu")
    ap.add_argument("--threads", type=int, default=0, help="torch threads of the CPU rank; 0: every core")
    args = ap.parse_args()
    threads = args.threads or torch.get_num_threads()
    print(f"torch {torch.__version__}, " + (torch.cuda.get_device_name() if torch.cuda.is_available() else "no CUDA"))
    print("| shape | device | dtype | step (s) | real tokens / s |\n| --- | --- | --- | --- | --- |")
    for name, (cfg, rows, prompt, new) in SHAPES.items():
        batch, real = _batch(cfg, rows, prompt, new)
        for device in args.devices.split(","):
            for dtype in ("float32", "bfloat16") if device == "cuda" else ("float32",):
                seconds = _time(cfg, batch, device, dtype, args.reps, threads)
                where = f"cpu, {threads} threads" if device == "cpu" else device
                print(f"| {name} | {where} | {dtype} | {seconds:.4f} | {real / seconds:,.0f} |", flush=True)


if __name__ == "__main__":
    main()
