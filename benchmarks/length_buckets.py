"""Length buckets: token slots per real token of a step's plan, and forward+backward time of its passes.

Slots per real token (``train_token_slots_per_real_token``: every slot run through the pipeline,
padding and empty microbatches included, over the prompt + completion tokens of the step) is a pure
planning computation over sampled stored lengths, for:

  fixed            today's single layout: M microbatches sized for every completion at max_new_tokens
  buckets          length buckets, padded rows, a variable pass count; widths 10, 11, 12 (and S)
                   on the tiny config (S = 13: sequences of 7..13 tokens), powers of two elsewhere
  buckets-packed   the same buckets, sequences packed end to end in each bucket's rows, passes of
                   m = 2 microbatches (the schedule's smallest count)
  packed-1-pass    the same, one pass per bucket holding all its microbatches (the default:
                   train.max_microbatches_per_pass unset)

Timing runs forward + backward of the GRPO loss over every microbatch of every pass in-process (no
pipeline; a pass's fill and drain are not in it), the variants interleaved per repetition, minimum
reported. Attention is dense SDPA with a block mask, O(T^2) per row whatever the documents.

    .venv/bin/python benchmarks/length_buckets.py [--reps 3] [--threads 1]
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch

from stages.policy import DecoderConfig, build_stage
from stages.tasks.addition import make_prompts
from stages.train.batch import build_global_batch
from stages.train.buckets import bucketed_layout, power_of_two_widths
from stages.train.loss import LossConfig, grpo_microbatch_loss
from stages.train.plan import microbatch_layout

_LOSS = LossConfig(kl_beta=0.02)
_M = 2  # microbatches per pass: 1F1B on 2 pipeline ranks


def lengths(kind: str, groups: int, G: int, max_new: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Prompt and completion lengths: addition prompts ("<bos>a+b=", 5..7 tokens); "tiny": the right
    answer for 70% of samples, any length up to the cap for the rest; "bench": log-normal completions
    (median 8, a long tail to the cap), ~16 real tokens a sequence."""
    rng = np.random.default_rng(seed)
    n = groups * G
    prompts = make_prompts(seed, 0, groups, 2)
    prompt_len = np.repeat([1 + len(p) for p in prompts], G)
    if kind == "tiny":
        answer = np.repeat([len(str(sum(map(int, p[:-1].split("+"))))) + 1 for p in prompts], G)
        return prompt_len, np.where(rng.random(n) < 0.3, rng.integers(1, max_new + 1, n), answer)
    return prompt_len, np.clip(rng.lognormal(np.log(8), 0.6, n).astype(int), 1, max_new)


def arrays_of(prompt_len: np.ndarray, length: np.ndarray, Pw: int, Gw: int, vocab: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    n = len(length)
    logp = (-np.log(vocab) + rng.normal(scale=0.05, size=(n, Gw))).astype(np.float32)
    return dict(prompt_ids=rng.integers(3, vocab, (n, Pw)).astype(np.int32), prompt_len=prompt_len.astype(np.int32),
                tokens=rng.integers(3, vocab, (n, Gw)).astype(np.int32), length=length.astype(np.int32),
                behav_logp=logp, ref_logp=logp, advantage=rng.normal(size=n).astype(np.float32))


def layouts(groups: int, G: int, Pw: int, Gw: int, budget: int) -> dict:
    S = Pw + Gw
    widths = (10, 11, 12) if S == 13 else power_of_two_widths(S)
    return {"fixed": microbatch_layout(groups, G, Pw, Gw, budget, False),
            "buckets": bucketed_layout(groups, G, Pw, Gw, budget, widths, False, _M),
            "buckets-packed": bucketed_layout(groups, G, Pw, Gw, budget, widths, True, _M),
            "packed-1-pass": bucketed_layout(groups, G, Pw, Gw, budget, widths, True, _M, max_microbatches=None,
                                             schedule=("1f1b", 2, 1))}


def ratio_table() -> None:
    print("| config | budget | fixed | buckets | buckets-packed | packed-1-pass |\n| --- | --- | --- | --- | --- | --- |")
    for kind, groups, G, Pw, Gw in (("tiny", 64, 8, 7, 6), ("bench", 16, 8, 7, 64)):
        S = Pw + Gw
        for k in ((64, 16, 8) if kind == "tiny" else (32, 8, 4, 2)):
            cells = []
            for name, lay in layouts(groups, G, Pw, Gw, k * S).items():
                ratios, passes = [], []
                for seed in range(5):
                    pl, L = lengths(kind, groups, G, Gw, seed)
                    batch = build_global_batch(arrays_of(pl, L, Pw, Gw, 16), "token-mean", 0, lay)
                    ratios.append(batch.slots_per_real_token)
                    passes.append(len(batch.passes))
                cells.append(f"{np.mean(ratios):.2f} ({np.mean(passes):.1f} passes)")
            print(f"| {kind} | {k} x {S} | " + " | ".join(cells) + " |")


def _seconds(model, batch) -> float:
    model.zero_grad(set_to_none=True)
    t0 = time.perf_counter()
    for p in batch.passes:
        m = p.num_microbatches or _M
        kw = {k: v.chunk(m) for k, v in p.stage_kwargs().items()}
        for j, (ids, tgt) in enumerate(zip(p.input_ids.chunk(m), p.target.chunk(m))):
            loss, _ = grpo_microbatch_loss(model(ids, **{k: v[j] for k, v in kw.items()}), tgt, _LOSS)
            loss.backward()
    return time.perf_counter() - t0


def _timing_step(groups: int, G: int, Pw: int, Gw: int):
    """(config, model, stored arrays) of the step both timings run: a hidden-128, 4-layer model and
    the bench length distribution."""
    cfg = DecoderConfig(vocab_size=512, hidden_size=128, intermediate_size=352, num_hidden_layers=4,
                        num_attention_heads=4, num_key_value_heads=2, head_dim=32, pad_token_id=0)
    model = build_stage(cfg)
    model.init_weights(torch.Generator().manual_seed(0))
    pl, L = lengths("bench", groups, G, Gw, 0)
    return cfg, model, arrays_of(pl, L, Pw, Gw, cfg.vocab_size)


def timing(reps: int) -> None:
    groups, G, Pw, Gw = 16, 8, 7, 64
    cfg, model, arrays = _timing_step(groups, G, Pw, Gw)
    real = int((arrays["prompt_len"].astype(int) + arrays["length"]).sum())
    print(f"\nbench lengths, model hidden 128 x 4 layers, budget 8 x {Pw + Gw}; real tokens {real}")
    batches = {name: build_global_batch(arrays, "token-mean", 0, lay)
               for name, lay in layouts(groups, G, Pw, Gw, 8 * (Pw + Gw)).items()}
    batches["fixed"] = build_global_batch(arrays, "token-mean", 0, microbatch_layout(groups, G, Pw, Gw, 8 * (Pw + Gw),
                                                                                      False))
    _seconds(model, batches["buckets"])  # warm-up
    times = {k: [] for k in batches}
    for _ in range(reps):
        for name, batch in batches.items():
            times[name].append(_seconds(model, batch))
    base = min(times["fixed"])
    print("| variant | passes | slots / real token | fwd+bwd s | time / fixed |\n| --- | --- | --- | --- | --- |")
    for name, batch in batches.items():
        print(f"| {name} | {len(batch.passes)} | {batch.slots_per_real_token:.2f} | {min(times[name]):.3f} | "
              f"{min(times[name]) / base:.2f} |")


def pipeline_timing(reps: int) -> None:
    """The same step through a 2-rank 1F1B pipeline (local processes): per-pass fill and drain included."""
    from stages.policy import hf_state
    from stages.train.engine import TrainSetup
    from stages.train.local import run_local_pipeline

    groups, G, Pw, Gw = 16, 8, 7, 64
    cfg, model, arrays = _timing_step(groups, G, Pw, Gw)
    print("\n2-rank 1F1B pipeline, same step; step_seconds = slowest rank, min over reps")
    print("| variant | passes | microbatches / DP rank | step s |\n| --- | --- | --- | --- |")
    for name, lay in layouts(groups, G, Pw, Gw, 8 * (Pw + Gw)).items():
        batch = build_global_batch(arrays, "token-mean", 0, lay)
        setup = TrainSetup(model=cfg, pipeline_parallel_size=2, num_microbatches=lay.num_microbatches,
                           schedule="1f1b", timeout_s=300)
        out = run_local_pipeline(setup, hf_state(model), [batch] * (reps + 1), calls=["grad"] * (reps + 1))
        step = min(max(o.steps[c].metrics["step_seconds"] for o in out) for c in range(1, reps + 1))
        total_mb = sum((p.num_microbatches or lay.num_microbatches) for p in getattr(batch, "passes", (batch,)))
        print(f"| {name} | {len(batch.passes)} | {total_mb} | {step:.3f} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    ratio_table()
    if args.reps:
        timing(args.reps)
        pipeline_timing(args.reps)


if __name__ == "__main__":
    main()
