"""What a packed row wider than the longest sequence costs and saves (train.length_buckets' 2S bucket).

Cost: one pipeline stage of an HF model folder (default SmolLM2-135M's first stage, 15 layers) runs a
microbatch of ``--slots`` token slots forward and backward on one thread, as rows of each of
``--widths``, every row packed with documents of ``--doc`` tokens under the dense document mask
the training step uses (the rest of a row is one padding document). The fastest of ``--reps``
after a warm-up is kept; the widths alternate, and each is printed in ms per slot and against the
first width.

Saving (``--rollouts``): the steps stored in a run's rollouts.zarr replanned by
stages/train/buckets.py ``plan_passes`` under the config's bucketed layout, with and without its
widths above S: slots per real token and microbatches per step.

    PYTHONPATH=$PWD .venv/bin/python benchmarks/packed_rows.py
    PYTHONPATH=$PWD .venv/bin/python benchmarks/packed_rows.py --reps 0 --rollouts runs/smollm2-arithmetic/rollouts.zarr
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from layer_split import _fastest  # noqa: E402

from flows.config import load_config  # noqa: E402
from stages.policy import DecoderConfig, build_stage, load_hf_state, stage_hf_names  # noqa: E402
from stages.train.buckets import bucketed_layout, plan_passes  # noqa: E402
from storage.policies import load_model_folder  # noqa: E402
from storage.rollouts import RolloutStore  # noqa: E402


def packed_doc_ids(rows: int, width: int, doc: int) -> torch.Tensor:
    """[rows, width] document ids: documents of ``doc`` tokens end to end, then one padding document."""
    col = torch.arange(width)
    full = (width // doc) * doc
    return torch.where(col < full, col // doc, width // doc).expand(rows, width).contiguous()


def seconds_per_slot(model_path: str, stage: int, widths: list[int], slots: int, doc: int, reps: int) -> dict[int, float]:
    hf, _, tensors = load_model_folder(model_path)
    cfg = DecoderConfig.from_hf(hf)
    module = build_stage(cfg, stage, 2, return_hidden=True)
    load_hf_state(module, {n: tensors[n] for n in stage_hf_names(module)})
    gen = torch.Generator().manual_seed(0)
    best = {w: float("inf") for w in widths}
    for _ in range(max(reps, 1)):
        for w in widths:
            rows = slots // w
            doc_ids = packed_doc_ids(rows, w, doc)
            x = (torch.randint(0, cfg.vocab_size, (rows, w), generator=gen) if stage == 0
                 else torch.randn(rows, w, cfg.hidden_size, generator=gen, requires_grad=True))

            def step():
                module.zero_grad(set_to_none=True)
                module(x, doc_ids=doc_ids).float().pow(2).mean().backward()

            best[w] = min(best[w], _fastest(step, 1) / (rows * w))
    return best


def replanned(config: str, rollouts: str) -> list[tuple[int, float, int, float, int]]:
    """(step, slots per real token and microbatches with the config's widths, the same without those above S)."""
    cfg = load_config(config)
    layout = cfg.microbatch_layout
    S = layout.max_seq_len
    narrow = bucketed_layout(cfg.task.prompts_per_step, cfg.rollout.group_size, cfg.prompt_width,
                             cfg.rollout.max_new_tokens, cfg.token_budget, [w for w in layout.widths if w <= S],
                             layout.packing, layout.microbatches_per_pass, layout.data_parallel_size,
                             layout.max_microbatches_per_pass, layout.schedule)
    store = RolloutStore(rollouts)
    out = []
    for step in store.steps():
        a = store.read(step, "prompt_len", "length")
        lengths = np.asarray(a["prompt_len"]) + np.asarray(a["length"])
        wide, plain = plan_passes(lengths, layout), plan_passes(lengths, narrow)
        out.append((step, wide.slots_per_real_token, sum(wide.pass_microbatches),
                    plain.slots_per_real_token, sum(plain.pass_microbatches)))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="models/smollm2-135m-instruct", help="an HF model folder")
    parser.add_argument("--stage", type=int, choices=(0, 1), default=0, help="which stage of a PP 2 split")
    parser.add_argument("--widths", type=int, nargs="+", default=[144, 288, 576])
    parser.add_argument("--slots", type=int, default=576, help="token slots of the microbatch")
    parser.add_argument("--doc", type=int, default=72, help="tokens of each packed document")
    parser.add_argument("--reps", type=int, default=3, help="alternations of the widths (0: no timing)")
    parser.add_argument("--config", default="configs/smollm2-arithmetic.yaml", help="the layout --rollouts replans under")
    parser.add_argument("--rollouts", help="a run's rollouts.zarr whose stored steps to replan")
    args = parser.parse_args()
    if any(args.slots % w for w in args.widths):
        parser.error(f"--slots {args.slots} must be a multiple of every width in --widths {args.widths}")
    if args.reps > 0:
        torch.set_num_threads(1)
        best = seconds_per_slot(args.model, args.stage, args.widths, args.slots, args.doc, args.reps)
        print(f"stage {args.stage} of {args.model}, {args.slots} slots, documents of {args.doc} tokens, 1 thread:")
        for w, s in best.items():
            print(f"  rows of {w:5d}: {s * 1e3:.3f} ms a slot ({s / best[args.widths[0]]:.3f}x rows of {args.widths[0]})")
    if args.rollouts:
        print(f"{args.rollouts} replanned under {args.config}:")
        for step, wide, wide_mb, plain, plain_mb in replanned(args.config, args.rollouts):
            print(f"  step {step}: {wide:.3f} slots per real token in {wide_mb} microbatches "
                  f"(without widths above S: {plain:.3f} in {plain_mb})")


if __name__ == "__main__":
    main()
