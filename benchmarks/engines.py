"""The rollout engines behind the contract on the real model: native vs vLLM vs transformers' generate.

SmolLM2-135M-Instruct (``make model``), 8 arithmetic prompts of data/arithmetic_train.jsonl in its chat
template (~60 tokens) x G 8, <= 64 new tokens, temperature 1, on every core of this machine:

  native  stages/rollout/native.py (the project's engine: paged, prefix-shared KV, continuous batching)
  vllm    stages/rollout/vllm_engine.py (vLLM in its server process: .venv-vllm, `make vllm`)
  hf      transformers' AutoModelForCausalLM.generate, do_sample, output_scores (the behaviour
          log-probs gathered from the scores, as a rollout needs them)

Workloads: ``skewed`` (the model stops at its EOS, so lengths spread) and ``fixed`` (no stop token:
every completion runs 64 tokens). In float32 and bfloat16. Each engine's first call is timed apart
(``first``: vLLM's CPU kernels are prepared at their first shapes); the table then keeps the fastest
of ``--reps`` calls, the engines interleaved per repetition. Also: each engine's start (model
load; vLLM's server start) and a weight update (a version's tensors loaded in place: from memory,
and from the folder).

    .venv/bin/python benchmarks/engines.py [--reps 2] [--dtype float32 --dtype bfloat16] [--no-hf]
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch

from stages.policy.tokenizer import TextCodec
from stages.rollout.contract import PolicyWeights, RolloutEngine
from stages.rollout.engine import EngineConfig, SamplingParams
from stages.rollout.native import NativeEngine
from stages.rollout.vllm_engine import VLLMEngine
from storage.policies import load_model_folder

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def _prompts(codec: TextCodec, num: int) -> list[list[int]]:
    with open("data/arithmetic_train.jsonl") as fh:
        rows = [json.loads(line) for _, line in zip(range(num), fh)]
    return [codec.encode_prompt(r["prompt"]) for r in rows]


class _HF:
    """transformers' generate behind the same call (prompts, params, seed) -> (tokens generated, seconds)."""

    kind = "hf"

    def __init__(self, path: str, dtype: torch.dtype):
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()

    @torch.no_grad()
    def generate(self, prompts, params: SamplingParams, seed: int) -> tuple[int, float]:
        t0 = time.perf_counter()
        torch.manual_seed(seed)
        rows = [p for p in prompts for _ in range(params.group_size)]
        width = max(len(p) for p in rows)
        pad = params.pad_id
        ids = torch.tensor([[pad] * (width - len(p)) + p for p in rows])
        attn = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in rows])
        stop = list(params.stop_ids) or None
        out = self.model.generate(ids, attention_mask=attn, do_sample=True, max_new_tokens=params.max_new_tokens,
                                  temperature=params.temperature, top_k=0, top_p=1.0, eos_token_id=stop,
                                  pad_token_id=pad, output_scores=True, return_dict_in_generate=True,
                                  min_new_tokens=0 if stop else params.max_new_tokens)
        new = out.sequences[:, width:]
        logp = torch.stack([torch.log_softmax(s.float(), -1) for s in out.scores], 1).gather(-1, new[..., None])
        assert logp.shape[:2] == new.shape
        if stop is None:
            return new.numel(), time.perf_counter() - t0
        is_stop = torch.isin(new, torch.tensor(stop))
        lengths = torch.where(is_stop.any(1), is_stop.float().argmax(1) + 1, torch.tensor(new.shape[1]))
        return int(lengths.sum()), time.perf_counter() - t0


def _timed(fn):
    t0 = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - t0


def _run_dtype(args, dtype_name: str, codec: TextCodec, prompts: list[list[int]], threads: int) -> list[dict]:
    dtype = _DTYPES[dtype_name]
    path, G, N = args.model, args.group_size, args.max_new_tokens
    weights = PolicyWeights(0, path, "benchmark")
    _, _, tensors = load_model_folder(path)
    engines, starts, updates = {}, {}, {}
    engines["native"] = RolloutEngine(NativeEngine("cpu", dtype, EngineConfig(max_num_seqs=len(prompts) * G)))
    engines["vllm"] = RolloutEngine(VLLMEngine(threads=threads, dtype=dtype, max_model_len=max(map(len, prompts)) + N,
                                               max_num_seqs=len(prompts) * G, timeout_s=1800))
    for name, engine in engines.items():
        _, starts[name] = _timed(lambda: engine.load(weights))
        _, memory_s = _timed(lambda: engine.load(PolicyWeights(1, path, "", tensors=tensors)))
        _, folder_s = _timed(lambda: engine.load(PolicyWeights(2, path, "")))
        updates[name] = (memory_s, folder_s)
    if not args.no_hf:
        hf, starts["hf"] = _timed(lambda: _HF(path, dtype))
        updates["hf"] = (float("nan"), float("nan"))

    def call(name: str, params: SamplingParams, seed: int) -> tuple[int, float]:
        if name == "hf":
            return hf.generate(prompts, params, seed)
        batch, seconds = _timed(lambda: engines[name].generate(2, prompts, params, seed))
        return int(batch.length.sum()), seconds

    names = list(engines) + ([] if args.no_hf else ["hf"])
    out = []
    for workload, stop in (("skewed", tuple(codec.eos_ids)), ("fixed", ())):
        params = SamplingParams(G, N, 1.0, 1.0, stop, codec.pad_id)
        first = {n: call(n, params, 0) for n in names}
        best: dict[str, tuple[int, float]] = {}
        for rep in range(args.reps):
            for n in names:
                tokens, seconds = call(n, params, rep + 1)
                if n not in best or tokens / seconds > best[n][0] / best[n][1]:
                    best[n] = (tokens, seconds)
        for n in names:
            tokens, seconds = best[n]
            out.append({"dtype": dtype_name, "workload": workload, "engine": n, "tokens": tokens, "seconds": seconds,
                        "tokens_per_s": tokens / seconds, "first_s": first[n][1], "start_s": starts[n],
                        "update_memory_s": updates[n][0], "update_folder_s": updates[n][1]})
    for engine in engines.values():
        engine.close()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("--model", default="models/smollm2-135m-instruct")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--group-size", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--dtype", action="append", choices=sorted(_DTYPES))
    ap.add_argument("--no-hf", action="store_true")
    args = ap.parse_args()
    threads = len(os.sched_getaffinity(0))
    torch.set_num_threads(threads)
    codec = TextCodec.from_policy_folder(args.model, True)
    prompts = _prompts(codec, args.prompts)
    rows = [r for d in (args.dtype or ["float32", "bfloat16"]) for r in _run_dtype(args, d, codec, prompts, threads)]
    print(f"\n{args.prompts} prompts x G {args.group_size}, <= {args.max_new_tokens} new tokens, {threads} threads; "
          "tokens/s: the fastest of --reps calls; first: the first call; x native: tokens/s over native's")
    print(f"{'dtype':9} {'workload':8} {'engine':7} {'tokens':>6} {'seconds':>8} {'tokens/s':>9} {'x native':>8} "
          f"{'first s':>8} {'start s':>8} {'update mem s':>12} {'update disk s':>13}")
    for r in rows:
        native = next(x for x in rows if x["dtype"] == r["dtype"] and x["workload"] == r["workload"]
                      and x["engine"] == "native")
        print(f"{r['dtype']:9} {r['workload']:8} {r['engine']:7} {r['tokens']:6d} {r['seconds']:8.2f} "
              f"{r['tokens_per_s']:9.1f} {r['tokens_per_s'] / native['tokens_per_s']:8.2f} {r['first_s']:8.2f} "
              f"{r['start_s']:8.2f} {r['update_memory_s']:12.2f} {r['update_folder_s']:13.2f}")


if __name__ == "__main__":
    main()
