"""What the kernels allow: the model's own forward + backward and its decode, alone, as a share of
the host's measured matmul rate (stages/perf/matmul_rate.py, the MFU denominator), on SmolLM2-135M
at the shapes configs/smollm2-arithmetic.yaml runs.

- train: forward + backward of the whole model on one packed row of ``--row`` tokens holding three
  documents (prompt 60 + completion of the rest each), the loss on the completion tokens only
  through the lm_head (as the chunked log-prob loss); FLOPs by stages/perf ``train_flops``.
- decode: ``stages.rollout.generate`` of ``--rows`` sequences (groups of 8 with one 60-token
  prompt each) for 48 tokens with no stop token; FLOPs by stages/perf ``rollout_flops``.

Each on 1 thread (a pipeline rank's, and one of the run's two engines: 32 rows) and on every core
(the single-process loop: 64 rows), against the rate measured with the same threads. Fastest of
``--reps`` after a warm-up. No iteration's MFU exceeds these shares, whatever its layout: the
bubble, the optimiser step, the writes and the rollout's tail of few live rows only lower them.
Then one AdamW step over the model's parameters on one thread, foreach (torch's default) against
fused (what the training ranks take), and with ``--profile`` torch.profiler's top ops of the
one-thread forward + backward.

    PYTHONPATH=$PWD .venv/bin/python benchmarks/ceiling.py --reps 3 [--profile]
"""

from __future__ import annotations

import argparse
import time

import torch

from stages.perf.matmul_rate import measure_matmul_rate
from stages.perf import rollout_flops, train_flops
from stages.policy import DecoderConfig, build_stage, load_hf_state
from stages.rollout.engine import SamplingParams, generate
from storage.policies import load_model_folder

_PROMPT, _NEW, _G = 60, 48, 8


def _train_seconds(model, row: int, reps: int) -> tuple[float, float]:
    """(fastest forward + backward seconds, its FLOPs) of one packed row of three documents."""
    cfg = model.cfg
    docs = [row // 3, row // 3, row - 2 * (row // 3)]
    doc_ids = torch.cat([torch.full((n,), i) for i, n in enumerate(docs)])[None]
    ids = torch.randint(0, cfg.vocab_size, (1, row))
    completion = torch.cat([torch.arange(n) >= _PROMPT for n in docs])  # positions whose next token is trained
    best = float("inf")
    for _ in range(reps + 1):
        model.zero_grad(set_to_none=True)
        t = time.perf_counter()
        hidden = model(ids, doc_ids=doc_ids)[0, completion]
        logp = torch.log_softmax(model.lm_head(hidden), dim=-1)
        logp.gather(-1, ids[0, completion][:, None]).sum().backward()
        best = min(best, time.perf_counter() - t)
    flops = train_flops(cfg, [_PROMPT] * 3, [n - _PROMPT for n in docs])
    return best, flops


def _decode_seconds(model, rows: int, reps: int) -> tuple[float, float]:
    """(fastest generate seconds, its FLOPs) of ``rows`` sequences, 48 tokens each."""
    prompts = [list(range(100 + g, 100 + g + _PROMPT)) for g in range(rows // _G)]
    params = SamplingParams(_G, _NEW, temperature=0.6)  # no stop ids: every row decodes 48 tokens
    best = float("inf")
    for rep in range(reps + 1):
        t = time.perf_counter()
        batch = generate(model, prompts, params, torch.Generator().manual_seed(rep))
        best = min(best, time.perf_counter() - t)
    flops = rollout_flops(model.cfg, batch.prompt_len, batch.length, group_size=_G)
    return best, flops


def _adamw_seconds(model, fused: bool, reps: int) -> float:
    """Fastest AdamW step over the model's parameters, random gradients, after a first step."""
    params = [p for p in model.parameters()]
    for p in params:
        p.grad = torch.randn_like(p) * 1e-3
    opt = torch.optim.AdamW(params, lr=1e-9, fused=True if fused else None)
    opt.step()
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        opt.step()
        best = min(best, time.perf_counter() - t)
    model.zero_grad(set_to_none=True)
    return best


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="models/smollm2-135m-instruct")
    p.add_argument("--row", type=int, default=288, help="tokens of the packed training row")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--profile", action="store_true", help="also torch.profiler's top ops of the one-thread "
                   "forward + backward")
    args = p.parse_args()
    hf_config, _, tensors = load_model_folder(args.model)
    cfg = DecoderConfig.from_hf(hf_config)
    model = build_stage(cfg, return_hidden=True)
    load_hf_state(model, tensors)
    cores = torch.get_num_threads()
    print(f"{args.model}, {cores} cores; shares of the matmul rate measured with the same threads")
    print("| phase | threads | shape | GFLOP/s | matmul rate GFLOP/s | share |")
    print("| --- | --- | --- | --- | --- | --- |")
    for threads, rows in ((1, 32), (cores, 64)):
        torch.set_num_threads(threads)
        rate = measure_matmul_rate("float32", threads=threads, seconds=2.0)
        model.return_hidden = True
        seconds, flops = _train_seconds(model, args.row, args.reps)
        print(f"| train forward + backward | {threads} | one row of {args.row} | {flops / seconds / 1e9:.1f} | "
              f"{rate / 1e9:.1f} | {flops / seconds / rate:.0%} |", flush=True)
        model.return_hidden = False
        with torch.no_grad():
            seconds, flops = _decode_seconds(model.eval(), rows, args.reps)
        model.train()
        print(f"| decode | {threads} | {rows} rows x {_NEW} tokens | {flops / seconds / 1e9:.1f} | "
              f"{rate / 1e9:.1f} | {flops / seconds / rate:.0%} |", flush=True)
    torch.set_num_threads(1)
    n = sum(p.numel() for p in model.parameters())
    foreach, fused = _adamw_seconds(model, False, args.reps), _adamw_seconds(model, True, args.reps)
    print(f"AdamW step, 1 thread, {n / 1e6:.0f} M parameters: foreach {foreach:.3f} s, fused {fused:.3f} s")
    if args.profile:
        model.return_hidden = True
        with torch.profiler.profile() as prof:
            _train_seconds(model, args.row, 0)
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=12))
    torch.set_num_threads(cores)


if __name__ == "__main__":
    main()
