"""The frozen reference's forward-only pass on two training ranks: pipelined (train.reference_parallel
= pipeline: each rank its stages, microbatches handed from rank to rank) against data-parallel
(= data: each rank the whole model and half of the microbatches, one reduction), beside one
process running the whole pass on both cores (two torch threads), as benchmarks/iteration.py's
single-process loop does.

Model sizes and batches of benchmarks/iteration.py's scenarios: tiny (hidden 64, 4 layers, 64 x G 8
sequences of 13 tokens, 8 microbatches) and bench (hidden 512, 8 layers, 16 x G 8 sequences of log-normal
length up to 71, packed into the scenario's length buckets). Ranks are local processes
(stages/train/local.py), one torch thread each; each variant runs ``--reps`` passes after one
warm-up, the variants alternate, and the medians are printed with their ratio to the pipelined pass.

    PYTHONPATH=$PWD .venv/bin/python benchmarks/reference_parallel.py --reps 5
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from iteration import scenario_config  # noqa: E402
from length_buckets import arrays_of, lengths  # noqa: E402

from stages.policy import DecoderConfig, build_stage, hf_state  # noqa: E402
from stages.train.batch import build_global_batch  # noqa: E402
from stages.train.engine import TrainSetup  # noqa: E402
from stages.train.local import run_local_pipeline  # noqa: E402
from stages.train.loss import TARGET_FIELDS, token_logp  # noqa: E402

_NEXT = TARGET_FIELDS.index("next_id")


def _step(scenario: str, overrides: list[str] = ()):
    cfg = scenario_config(scenario, "/tmp/reference-parallel", "bench", 2, list(overrides))
    m = cfg.model
    model_cfg = DecoderConfig(vocab_size=16, hidden_size=m.hidden_size, intermediate_size=m.intermediate_size,
                              num_hidden_layers=m.num_hidden_layers, num_attention_heads=m.num_attention_heads,
                              num_key_value_heads=m.num_key_value_heads,
                              head_dim=m.hidden_size // m.num_attention_heads, pad_token_id=0)
    model = build_stage(model_cfg)
    model.init_weights(torch.Generator().manual_seed(0))
    G, new = cfg.rollout.group_size, cfg.rollout.max_new_tokens
    prompt_len, length = lengths("tiny" if scenario == "tiny" else "bench", cfg.task.prompts_per_step, G, new, 0)
    arrays = arrays_of(prompt_len, length, cfg.prompt_width, new, model_cfg.vocab_size)
    return cfg, model_cfg, model, build_global_batch(arrays, "token-mean", 0, cfg.microbatch_layout)


def _pipeline_seconds(cfg, model_cfg, model, batch, mode: str, reps: int) -> list[float]:
    setup = TrainSetup(model=model_cfg, pipeline_parallel_size=2, num_microbatches=cfg.num_microbatches,
                       schedule="1f1b", timeout_s=300, reference_parallel=mode)
    out = run_local_pipeline(setup, hf_state(model), [batch] * (reps + 1), calls=["reference"] * (reps + 1))
    return [max(o.steps[c].metrics["step_seconds"] for o in out) for c in range(1, reps + 1)]


@torch.no_grad()
def _one_process_seconds(cfg, model, batch, reps: int) -> list[float]:
    torch.set_num_threads(2)
    out = []
    for _ in range(reps + 1):
        t0 = time.perf_counter()
        for p in batch.passes:
            token_logp(model(p.input_ids, **p.stage_kwargs()), p.target[..., _NEXT].long(), 1.0)
        out.append(time.perf_counter() - t0)
    torch.set_num_threads(1)
    return out[1:]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=2, help="alternations of the three variants")
    args = parser.parse_args()
    print("| scenario | pipelined (s) | data-parallel (s) | one process, 2 threads (s) | data / pipelined | "
          "data / one process |\n| --- | --- | --- | --- | --- | --- |")
    for scenario in ("tiny", "bench"):
        cfg, model_cfg, model, batch = _step(scenario)
        times: dict[str, list[float]] = {"pipeline": [], "data": [], "one": []}
        for _ in range(args.rounds):
            for mode in ("pipeline", "data"):
                times[mode] += _pipeline_seconds(cfg, model_cfg, model, batch, mode, args.reps)
            times["one"] += _one_process_seconds(cfg, model, batch, args.reps)
        med = {k: statistics.median(v) for k, v in times.items()}
        print(f"| {scenario} | {med['pipeline']:.4f} | {med['data']:.4f} | {med['one']:.4f} | "
              f"{med['data'] / med['pipeline']:.2f} | {med['data'] / med['one']:.2f} |", flush=True)


if __name__ == "__main__":
    main()
