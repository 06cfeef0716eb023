"""Padding vs sequence packing of a step's microbatches: token slots and forward+backward time.

Every layout keeps the run's fixed shape (stages/train/plan.py): the same number M of microbatches
each step, sized for the worst case (every completion at max_new_tokens). For each scenario the
script builds one step's global batch four ways and times forward + backward of the GRPO loss over
its microbatches, in-process, the variants interleaved in each repetition (median reported):

  padding        one sequence per row, [R, S] per microbatch, M microbatches
  packed-1row    the microbatch is one packed row of B = max_tokens_per_microbatch slots
  packed-kS      packed rows of k x S slots (k = 2, 4)
  ...-used       the same, but only the microbatches the plan filled: what a variable
                 microbatch count (e.g. gradient accumulation over pipeline passes) would run

Time is the minimum over --reps interleaved repetitions (the least disturbed by other work on a
shared machine). Attention is dense SDPA with a boolean block mask, O(T^2) per row whatever the
documents; a varlen / block-sparse kernel would skip the masked blocks.

    .venv/bin/python benchmarks/packing.py [--reps 5] [--threads 1]
"""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass

import numpy as np
import torch

from stages.policy import DecoderConfig, build_stage
from stages.tasks.addition import make_prompts
from stages.train.batch import build_global_batch
from stages.train.loss import LossConfig, grpo_microbatch_loss
from stages.train.plan import microbatch_layout

_LOSS = LossConfig(kl_beta=0.02)


@dataclass(frozen=True)
class Scenario:
    name: str
    model: DecoderConfig
    num_groups: int
    group_size: int
    prompt_width: int
    max_new_tokens: int
    samples_per_microbatch: int  # the padded layout's rows; budget B = this x S


def _tiny_model(vocab: int, hidden: int, inter: int, layers: int, heads: int, kv: int) -> DecoderConfig:
    return DecoderConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
                         num_attention_heads=heads, num_key_value_heads=kv, head_dim=hidden // heads,
                         pad_token_id=0)


SCENARIOS = [
    # configs/tiny.yaml: 16 prompts x G 8, "<bos>a+b=" prompts (5..7 tokens), <= 6 new tokens.
    Scenario("tiny (addition)", _tiny_model(15, 64, 176, 4, 4, 2), 16, 8, 7, 6, 32),
    # LLM-like lengths: long generation budget, most completions far shorter (log-normal).
    Scenario("long-tail", _tiny_model(512, 128, 352, 4, 4, 2), 8, 8, 32, 224, 8),
]


def scenario_lengths(sc: Scenario, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    n = sc.num_groups * sc.group_size
    if sc.name.startswith("tiny"):
        prompts = make_prompts(0, 0, sc.num_groups, 2)
        prompt_len = np.repeat([1 + len(p) for p in prompts], sc.group_size)
        answer = np.repeat([len(str(sum(map(int, p[:-1].split("+"))))) + 1 for p in prompts], sc.group_size)
        wrong = rng.random(n) < 0.3  # a wrong completion: any length up to the cap
        length = np.where(wrong, rng.integers(1, sc.max_new_tokens + 1, n), answer)
    else:
        prompt_len = rng.integers(sc.prompt_width // 2, sc.prompt_width + 1, n)
        length = np.clip(rng.lognormal(np.log(60), 0.7, n).astype(int), 1, sc.max_new_tokens)
    return prompt_len, length


def scenario_arrays(sc: Scenario, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    n = sc.num_groups * sc.group_size
    prompt_len, length = scenario_lengths(sc, rng)
    V, Pw, Gw = sc.model.vocab_size, sc.prompt_width, sc.max_new_tokens
    logp = -np.log(V) + rng.normal(scale=0.05, size=(n, Gw))
    return dict(prompt_ids=rng.integers(3, V, (n, Pw)).astype(np.int32), prompt_len=prompt_len.astype(np.int32),
                tokens=rng.integers(3, V, (n, Gw)).astype(np.int32), length=length.astype(np.int32),
                behav_logp=logp.astype(np.float32), ref_logp=logp.astype(np.float32),
                advantage=rng.normal(size=n).astype(np.float32))


def _microbatches(batch, num: int, used: int):
    kw = {k: v.chunk(num) for k, v in batch.stage_kwargs().items()}
    return [(ids, tgt, {k: v[m] for k, v in kw.items()})
            for m, (ids, tgt) in enumerate(zip(batch.input_ids.chunk(num), batch.target.chunk(num))) if m < used]


def _fwd_bwd_seconds(model, microbatches) -> float:
    model.zero_grad(set_to_none=True)
    t0 = time.perf_counter()
    for ids, tgt, kw in microbatches:
        loss, _ = grpo_microbatch_loss(model(ids, **kw), tgt, _LOSS)
        loss.backward()
    return time.perf_counter() - t0


def run_scenario(sc: Scenario, reps: int) -> list[tuple[str, int, int, float]]:
    """(variant, microbatches run, token slots, min seconds) per variant."""
    S = sc.prompt_width + sc.max_new_tokens
    B = sc.samples_per_microbatch * S
    arrays = scenario_arrays(sc)
    model = build_stage(sc.model)
    model.init_weights(torch.Generator().manual_seed(0))
    variants = {}
    for name, packing, row_tokens in (("padding", False, None), ("packed-1row", True, None),
                                      ("packed-2S", True, 2 * S), ("packed-4S", True, 4 * S)):
        layout = microbatch_layout(sc.num_groups, sc.group_size, sc.prompt_width, sc.max_new_tokens, B,
                                   packing, row_tokens)
        batch = build_global_batch(arrays, "token-mean", 0, layout)
        M = layout.num_microbatches
        variants[name] = (_microbatches(batch, M, M), layout.tokens_per_microbatch)
        if packing and batch.plan.num_used < M:
            variants[name + "-used"] = (_microbatches(batch, M, batch.plan.num_used), layout.tokens_per_microbatch)
    _fwd_bwd_seconds(model, variants["padding"][0][:1])  # warm-up
    times: dict[str, list[float]] = {k: [] for k in variants}
    for _ in range(reps):
        for name, (mbs, _) in variants.items():
            times[name].append(_fwd_bwd_seconds(model, mbs))
    return [(name, len(mbs), len(mbs) * slots, min(times[name])) for name, (mbs, slots) in variants.items()]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    for sc in SCENARIOS:
        arrays = scenario_arrays(sc)
        real = int((arrays["prompt_len"] + arrays["length"]).sum())
        S = sc.prompt_width + sc.max_new_tokens
        print(f"\n## {sc.name}: {sc.num_groups} groups x G {sc.group_size}, S = {sc.prompt_width} + "
              f"{sc.max_new_tokens} = {S}, budget B = {sc.samples_per_microbatch} x {S} = "
              f"{sc.samples_per_microbatch * S} slots; real tokens {real}")
        rows = run_scenario(sc, args.reps)
        base = rows[0][3]
        print(f"{'variant':<17} {'microbatches':>12} {'token slots':>12} {'padding %':>10} {'fwd+bwd s':>10} "
              f"{'time / padding':>15}")
        for name, m, slots, sec in rows:
            print(f"{name:<17} {m:>12} {slots:>12} {100 * (1 - real / slots):>9.1f}% {sec:>10.4f} "
                  f"{sec / base:>15.2f}")


if __name__ == "__main__":
    main()
