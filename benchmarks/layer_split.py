"""Per-stage forward + backward seconds of a PP 2 split, even against train.layer_split=auto.

Each stage of an HF model folder (default SmolLM2-135M) runs one microbatch (``--rows`` rows of
prompt ``--prompt`` + ``--new`` tokens: the smollm2-arithmetic row shape) forward and backward alone
in this process on one thread, the last stage with its loss (full logits, or chunked log-probs as
train.logprob_chunk_tokens does); the fastest of ``--reps`` after a warm-up is kept (other jobs only
ever slow a run down). Completion lengths are uniform in 1..new (seeded), or all at ``--new`` with
``--full-length``. Auto is the run's rule: planner/training.py ``estimate_head_layers`` and
stages/layout ``balanced_layer_split``.

    PYTHONPATH=$PWD .venv/bin/python benchmarks/layer_split.py
    PYTHONPATH=$PWD .venv/bin/python benchmarks/layer_split.py --loss chunked --splits 17/13 --full-length
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from length_buckets import arrays_of  # noqa: E402

from planner.model import ModelShape as PlannerShape  # noqa: E402
from planner.training import estimate_head_layers  # noqa: E402
from stages.layout import balanced_layer_split, layers_per_stage  # noqa: E402
from stages.policy import DecoderConfig, build_stage, load_hf_state, stage_hf_names  # noqa: E402
from stages.train.batch import build_global_batch  # noqa: E402
from stages.train.loss import LossConfig, grpo_microbatch_loss, make_chunked_loss  # noqa: E402
from storage.policies import load_model_folder  # noqa: E402

_LOSS = LossConfig(0.2, 0.2, 0.0, 0.6)
_CHUNK_TOKENS = 256  # configs/smollm2-arithmetic.yaml's train.logprob_chunk_tokens


def _fastest(fn, reps: int) -> float:
    fn()  # warm-up: allocator, gradient buffers
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def stage_seconds(cfg: DecoderConfig, tensors: dict, split: tuple[int, int], batch, chunk: int | None,
                  reps: int) -> tuple[float, float]:
    """(first stage, last stage with its loss) forward + backward seconds of the batch."""
    first = build_stage(cfg, 0, 2, layer_split=split)
    last = build_stage(cfg, 1, 2, layer_split=split, return_hidden=chunk is not None)
    for stage in (first, last):
        load_hf_state(stage, {n: tensors[n] for n in stage_hf_names(stage)})
    ids, target = batch.input_ids, batch.target
    with torch.no_grad():
        hidden = first(ids)  # [rows, T, d]
    grad = torch.randn(hidden.shape, generator=torch.Generator().manual_seed(0)) * 1e-3
    loss_fn = (make_chunked_loss(last.lm_head, _LOSS, chunk) if chunk is not None
               else lambda out, tgt: grpo_microbatch_loss(out, tgt, _LOSS)[0])

    def run_first() -> None:
        first.zero_grad(set_to_none=True)
        first(ids).backward(grad)

    def run_last() -> None:
        last.zero_grad(set_to_none=True)
        loss_fn(last(hidden.detach().requires_grad_(True)), target).backward()

    return _fastest(run_first, reps), _fastest(run_last, reps)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="models/smollm2-135m-instruct")
    parser.add_argument("--loss", choices=("full", "chunked", "both"), default="both")
    parser.add_argument("--rows", type=int, default=4)
    parser.add_argument("--prompt", type=int, default=96)
    parser.add_argument("--new", type=int, default=48)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--full-length", action="store_true", help="every completion at --new tokens")
    parser.add_argument("--splits", nargs="*", default=[], metavar="N0/N1", help="more splits to time")
    args = parser.parse_args()
    torch.set_num_threads(1)
    hf, _, tensors = load_model_folder(args.model)
    cfg = DecoderConfig.from_hf(hf)
    rng = np.random.default_rng(0)
    length = np.full(args.rows, args.new) if args.full_length else rng.integers(1, args.new + 1, args.rows)
    arrays = arrays_of(np.full(args.rows, args.prompt), length, args.prompt, args.new, cfg.vocab_size)
    batch = build_global_batch(arrays, "token-mean", 0)
    shape = PlannerShape(**{f.name: getattr(cfg, f.name) for f in dataclasses.fields(PlannerShape)
                            if hasattr(cfg, f.name) and f.name not in ("name", "gated_mlp")})
    seq_len, even = args.prompt + args.new, layers_per_stage(cfg.num_hidden_layers, 2)
    print(f"{args.model}: {int(length.sum())} of {args.rows * args.new} completion slots trained; "
          f"one microbatch of {args.rows} x {seq_len} tokens")
    print("| loss | h | split | stage 0 s | stage 1 s | slower / faster |\n|---|---|---|---|---|---|")
    for loss in ("full", "chunked") if args.loss == "both" else (args.loss,):
        chunk = _CHUNK_TOKENS if loss == "chunked" else None
        head = estimate_head_layers(shape, seq_len, chunked_new_tokens=args.new if chunk else None)
        auto = balanced_layer_split(cfg.num_hidden_layers, 2, head)
        extra = [tuple(int(n) for n in s.split("/")) for s in args.splits]
        for split in dict.fromkeys([even, auto, *extra]):
            a, b = stage_seconds(cfg, tensors, split, batch, chunk, args.reps)
            name = f"{split[0]} / {split[1]}" + (" (auto)" if split == auto else "")
            print(f"| {loss} | {head:.1f} | {name} | {a:.2f} | {b:.2f} | {max(a, b) / min(a, b):.2f} |", flush=True)


if __name__ == "__main__":
    main()
