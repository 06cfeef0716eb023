"""Whole-iteration benchmark: ``grpoflow run`` against a single-process GRPO loop on the same model.

The baseline is the same iteration with nothing but compute: one process, a plain loop, no Dask,
no Zarr, no MLflow, no pipeline. It generates with the project's engine (stages/rollout) the rows
the run generates (each of the run's rollout ranges with its task's seed, all in one engine call
over every prompt: the loop's best layout; the report gives the share of rows that came out the
same, step by step: after step 0 the two policies differ in float summation order only), scores
with the project's reward, takes the project's advantages, runs the frozen reference over the
step's batch (the same microbatch layout, length buckets included) and takes one AdamW step on the
project's GRPO loss, on every core the process has (grpoflow's thread rule). grpoflow runs the configured pipeline on
its embedded Dask cluster from the same base policy.

The two alternate, several repetitions each (the machine is shared: compare ratios, not seconds).
Each grpoflow run's folder is removed once measured (unless ``--runs-dir`` keeps them): run folders
left in the page cache leave the next runs little free memory, and every page a run then touches
is first reclaimed (kernel time in its page faults). The first line printed is the memory available.
Per run, the first iteration is dropped (cluster and pipeline warm-up) and the median of the rest
is kept. grpoflow's seconds per iteration are its step windows (from one step's last training-rank
task end to the next one's: publication, lineage and submission included), the wall time a step
costs the run; ``iteration_seconds`` (submission to the last stage's end) is printed beside them,
and after them the window part by part, read from each run's folder (benchmarks/critical_path.py).
Scenarios:

- tiny: configs/tiny.yaml as shipped (64 prompts x G 8, 6 new tokens, PP 2).
- smollm2: configs/smollm2-arithmetic.yaml as shipped (SmolLM2-135M-Instruct, 8 prompts x G 8, up
  to 48 new tokens, PP 2, kl_beta 0: no reference pass in either), without its evaluation; needs
  `make model`. The loop uses the same chunked log-prob loss as the run.
- bench: hidden 512, 8 layers, 16 prompts x G 8, up to 64 new tokens, PP 2, length buckets
  [16, 32, 71], packed (train.length_buckets=auto and train.packing=auto pick them at S = 71),
  two rollout engines of one thread each (faster than one engine on two threads here:
  docs/performance.md). Policy v0 is the untrained model (warmup.steps=0): EOS has probability
  ~1/vocab per token, so completion lengths spread geometrically, mean ~16 of 64.

With ``rollout.max_staleness=1`` (an override) grpoflow generates step k+1 while it trains step k:
another algorithm (one version stale, decoupled PPO), measured against the same synchronous loop on
every core.

    python benchmarks/iteration.py --scenario tiny --reps 3 --iterations 4
    python benchmarks/iteration.py --scenario bench --reps 2 --iterations 3
    python benchmarks/iteration.py --scenario smollm2 --reps 1 --iterations 3

On one GPU (benchmarks/gpu.sh): the loop there too, both in float32, grpoflow with one training rank:

    python3 benchmarks/iteration.py --scenario tiny --device cuda train.pipeline_model_parallel_size=1 \
        rollout.num_engines=1 train.device=cuda rollout.dtype=float32
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch

from flows.config import load_config
from flows.loop import run, run_folder
from flows.config import GRPOConfig
from flows.worker import phase_threads
from stages.advantage import normalize_advantages
from stages.perf import step_model_flops
from stages.policy import DecoderConfig, build_stage, load_hf_state
from stages.policy.tokenizer import TextCodec
from flows.iteration import prompt_ranges, step_layout
from stages.rollout.engine import EngineConfig, Rollout, _PlainRunner, assemble, draw_seed, new_cache, run_engine
from stages.rollout.rows import (RolloutRows, cut_at_stop_strings, first_group_id, rollout_rows, rollout_seed,
                                 sampling_params)
from stages.rollout.sampling import counter_uniforms
from stages.reward.rows import reward_statistics, score_rows
from stages.train.setup import train_setup
from stages.data import open_prompt_source
from stages.train.batch import BucketedBatch, build_global_batch
from stages.train.loss import TARGET_FIELDS, grpo_chunked_loss, grpo_microbatch_loss, token_logp
from storage.policies import load_model_folder
from storage.rollouts import RolloutStore

from critical_path import PARTS, medians, run_parts

_NEXT = TARGET_FIELDS.index("next_id")

SCENARIOS: dict[str, list[str]] = {
    "tiny": [],
    "bench": ["model.hidden_size=512", "model.intermediate_size=1376", "model.num_hidden_layers=8",
              "model.num_attention_heads=8", "model.num_key_value_heads=4", "task.prompts_per_step=16",
              "rollout.max_new_tokens=64", "warmup.steps=0", "train.micro_batch_size=8", "rollout.num_engines=2"],
}


# Scenarios on a config other than configs/tiny.yaml.
_BASE_CONFIGS = {"smollm2": "configs/smollm2-arithmetic.yaml"}
SCENARIOS["smollm2"] = ["eval.path=null"]  # the config as shipped, without its held-out evaluation


def scenario_config(name: str, runs_dir: str, run_name: str, iterations: int, extra: list[str]) -> GRPOConfig:
    return load_config(_BASE_CONFIGS.get(name, "configs/tiny.yaml"),
                       [*SCENARIOS[name], f"iterations={iterations}", f"run_name={run_name}", f"runs_dir={runs_dir}",
                        *extra])


def grpoflow_iterations(cfg: GRPOConfig) -> list[dict[str, float]]:
    """Per-step metrics of one ``grpoflow run`` (a fresh run folder each time)."""
    return run(cfg, progress=False).metrics


def _passes(batch):
    return getattr(batch, "passes", (batch,))


def _sync(device: torch.device) -> None:
    """Wait for the work queued on ``device`` (a CUDA step returns before its kernels finish)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _to(pass_, device: torch.device):
    """One pass's input ids, stage kwargs and loss targets on ``device``."""
    return (pass_.input_ids.to(device), {k: v.to(device) for k, v in pass_.stage_kwargs().items()},
            pass_.target.to(device))


def baseline_iterations(cfg: GRPOConfig, policy_path: str, device: str = "cpu") -> list[dict[str, float]]:
    """The same iterations in this process, plain (see the module docstring); per-step seconds.
    ``device``: where the loop's models compute, in float32 (the engine generates where they are)."""
    # Every core the process has, by grpoflow's own rule for one busy engine (1 on an oversubscribed
    # host, where more intra-op threads only wait on each other: docs/performance.md). The loop is
    # one synchronous process whatever rollout.max_staleness, rollout.num_engines or
    # cluster.placement say, so it takes the rule for one decoupled engine and no overlap: otherwise
    # the rule would share the cores among engines and pools this process does not have.
    sync_cfg = replace(cfg, rollout=replace(cfg.rollout, max_staleness=0, num_engines=1),
                       cluster=replace(cfg.cluster, placement="decoupled"))
    torch.set_num_threads(phase_threads(sync_cfg, "rollout"))
    hf_config, tokenizer_json, tensors = load_model_folder(policy_path)
    model_cfg = DecoderConfig.from_hf(hf_config)
    # The same loss path as the run's: with chunked log-probs the models return hidden states and
    # the loss applies the head chunk by chunk (stages/train/loss.py).
    chunk = cfg.logprob_chunk_tokens
    policy, reference = build_stage(model_cfg, return_hidden=chunk is not None), build_stage(model_cfg)
    load_hf_state(policy, tensors)
    load_hf_state(reference, tensors)
    reference.requires_grad_(False).eval()
    dev = torch.device(device)
    policy.to(dev)
    reference.to(dev)
    codec = TextCodec.from_policy_folder(policy_path, cfg.dataset.chat_template, cfg.dataset.system_prompt)
    source = open_prompt_source(cfg.dataset, codec, cfg.task.prompts_per_step)
    t, G = cfg.train, cfg.rollout.group_size
    loss_cfg = train_setup(t, model_cfg, cfg.num_microbatches, cfg.rollout.temperature).loss
    optimizer = torch.optim.AdamW(policy.parameters(), lr=cfg.lr, weight_decay=t.weight_decay, fused=True)  # as the run's
    pad, layout = model_cfg.pad_token_id or 0, cfg.microbatch_layout
    step_rows = step_layout(cfg)  # the run's rollout ranges, one per engine
    ranges = prompt_ranges(step_rows.num_prompts, step_rows.chunk_samples // G, cfg.rollout.num_engines)
    out, out_tokens = [], []
    for step in range(cfg.iterations):
        t0 = time.perf_counter()
        policy.eval()
        policy.return_hidden = False  # the engine samples from logits
        records = source.records(step)
        with torch.inference_mode():  # samples from the weights it trains
            rows = _generate_as_the_run(policy, codec, [r.prompt_ids for r in records], cfg, step, ranges)
        t1 = time.perf_counter()
        out_tokens.append(rows.arrays["tokens"])
        a = dict(rows.arrays)
        scored = score_rows(codec, a, records, G, cfg.reward)
        a["reward"] = scored.reward
        a["advantage"] = normalize_advantages(scored.reward, G, cfg.advantage)
        a["ref_logp"] = np.zeros_like(a["behav_logp"])
        t2 = time.perf_counter()
        if t.uses_reference:  # as the run: no reference pass when the loss does not read it (kl_beta 0)
            batch = build_global_batch(a, t.loss_aggregation, pad, layout)
            with torch.no_grad():
                ref = []
                for p in _passes(batch):
                    ids, kwargs, target = _to(p, dev)
                    ref.append(token_logp(reference(ids, **kwargs), target[..., _NEXT].long(),
                                          loss_cfg.temperature).cpu())
            a["ref_logp"] = batch.completion_values(ref if isinstance(batch, BucketedBatch) else ref[0])
        t3 = time.perf_counter()
        batch = build_global_batch(a, t.loss_aggregation, pad, layout)
        policy.train()
        policy.return_hidden = chunk is not None  # the chunked loss applies the head itself
        optimizer.zero_grad(set_to_none=True)
        for p in _passes(batch):  # every loss weight is global: the passes' gradients add up exactly
            ids, kwargs, target = _to(p, dev)
            if chunk is None:
                loss, _ = grpo_microbatch_loss(policy(ids, **kwargs), target, loss_cfg)
            else:
                loss, _ = grpo_chunked_loss(policy(ids, **kwargs), target, policy.lm_head, loss_cfg, chunk)
            loss.backward()
        torch.nn.utils.clip_grad_norm_(policy.parameters(), t.max_grad_norm)
        optimizer.step()
        _sync(dev)
        t4 = time.perf_counter()
        out.append({"iteration_seconds": t4 - t0, "rollout_seconds": t1 - t0,
                    "rollout_compute_seconds": rows.metrics["rollout_seconds"], "reward_advantage_seconds": t2 - t1,
                    "reference_seconds": t3 - t2, "train_seconds": t4 - t3,
                    "train_token_slots_per_real_token": float(batch.slots_per_real_token),
                    "train_passes": float(len(_passes(batch))),
                    "model_flops": sum(step_model_flops(model_cfg, a["prompt_len"], a["length"], group_size=G,
                                                        reference=t.uses_reference).values()),
                    **reward_statistics(scored.reward, a["length"], G)})
    return out, out_tokens


class _RangedRollout(Rollout):
    """The sampling state of one engine call over the prompts of several of the run's rollout
    ranges: each range draws with its own task's seed and counts its prompts from its first, so the
    call samples what the run's engines sample, one range each (stages/rollout/sampling.py: a
    token's uniform is a function of seed, prompt, sample and token only)."""

    def __init__(self, prompts, params, ranges: list[tuple[int, int]], seeds: list[int]):
        super().__init__(prompts, params, seed=0)
        self.ranges, self.seeds = ranges, seeds

    def uniforms(self, rows: np.ndarray, stream: int = 0, offset: np.ndarray | int = 0) -> torch.Tensor:
        G = self.params.group_size
        prompt, offset = rows // G, np.broadcast_to(offset, rows.shape)
        out = torch.empty(len(rows), dtype=torch.float64)
        for (lo, hi), seed in zip(self.ranges, self.seeds):
            sel = (prompt >= lo) & (prompt < hi)
            if sel.any():
                out[torch.from_numpy(sel)] = counter_uniforms(seed, prompt[sel] - lo, rows[sel] % G,
                                                              self.length[rows[sel]] + offset[sel], stream)
        return out


def _generate_as_the_run(model, codec, prompts, cfg: GRPOConfig, step: int,
                         ranges: list[tuple[int, int]]) -> RolloutRows:
    """The step's rows as the run's rollout tasks generate them (stages/rollout/rows.py
    generate_rows, one task per range, each seeded by its first prompt), in one call of the engine
    over every prompt: one batch on every core, the loop's best layout."""
    params, engine = sampling_params(cfg.rollout, codec), EngineConfig()
    seeds = [draw_seed(torch.Generator().manual_seed(rollout_seed(cfg.seed, step, lo))) for lo, _ in ranges]
    start = time.perf_counter()
    state = _RangedRollout(prompts, params, ranges, seeds)
    cache = new_cache(model, prompts, params, engine)
    steps = run_engine(_PlainRunner(model, cache), state, engine.max_num_seqs)
    batch = cut_at_stop_strings(assemble(state, cache, time.perf_counter() - start, steps), codec, cfg.rollout.stop)
    return rollout_rows(batch, cfg.prompt_width, codec.pad_id, first_group_id(step, cfg.task.prompts_per_step, 0),
                        cfg.rollout.group_size, step)


def _median_after_first(steps: list[dict[str, float]], key: str) -> float:
    values = [s[key] for s in steps[1:] if key in s] or [s[key] for s in steps if key in s]
    return statistics.median(values) if values else float("nan")


_FLOW_KEYS = ("step_window_seconds", "iteration_seconds", "rollout_seconds", "rollout_compute_seconds", "reward_seconds",
              "reference_seconds", "reference_compute_seconds", "advantage_seconds", "train_seconds",
              "train_step_seconds", "publish_seconds", "host_cpu_seconds",
              "train_token_slots_per_real_token", "train_passes",
              "completion_length_mean", "mfu", "mfu_rollout", "mfu_train", "matmul_flops_per_s")
_BASE_KEYS = ("iteration_seconds", "rollout_seconds", "rollout_compute_seconds", "reward_advantage_seconds",
              "reference_seconds", "train_seconds", "train_token_slots_per_real_token", "train_passes",
              "completion_length_mean", "model_flops")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--scenario", choices=sorted(SCENARIOS), default="tiny")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--iterations", type=int, default=4, help="per run; the first is dropped")
    p.add_argument("--runs-dir", default=None, help="keep every run folder here (default: a temporary folder, "
                   "each run's folder removed once measured, the base-policy cache kept across repetitions, and the "
                   "folder itself removed at the end)")
    p.add_argument("--json", default=None, help="also write the raw per-rep numbers here")
    p.add_argument("--device", default="cpu", help="the loop's device (cpu, cuda); for a like-for-like CUDA "
                   "comparison give grpoflow train.device=cuda rollout.dtype=float32 (the loop computes in float32)")
    p.add_argument("overrides", nargs="*", help="key=value on top of the scenario")
    args = p.parse_args()
    print(f"host memory available: {_memory_available()}", flush=True)
    runs_dir = args.runs_dir or tempfile.mkdtemp(prefix="iteration-bench-")
    try:
        reps, cfg = _measure(args, runs_dir)
    finally:
        if args.runs_dir is None:
            shutil.rmtree(runs_dir, ignore_errors=True)
    _report(args.scenario, reps, overlapping=cfg.rollout.max_staleness >= 1)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(reps, fh, indent=1)


def _memory_available() -> str:
    """MemAvailable of MemTotal (Linux). Little available memory slows the run that writes files:
    each new page it touches is first reclaimed from the page cache (kernel time in its page
    faults), a cost the loop, which writes nothing, does not pay to the same degree."""
    try:
        info = dict(line.split(":", 1) for line in Path("/proc/meminfo").read_text().splitlines())
        gib = {k: int(info[k].split()[0]) / 2**20 for k in ("MemAvailable", "MemTotal")}
        return f"{gib['MemAvailable']:.1f} of {gib['MemTotal']:.1f} GiB"
    except (OSError, KeyError, ValueError):
        return "unknown"


def _measure(args, runs_dir: str) -> tuple[list[dict], GRPOConfig]:
    """The interleaved repetitions, and the last one's config. Without --runs-dir each grpoflow
    run's folder is removed once its metrics are read (a bench run writes ~0.8 GB of versions; left
    behind, they fill the page cache the next runs allocate from); a copy of the first run's policy
    v0 is kept, which every loop starts from."""
    reps = []
    base_path = None
    for rep in range(args.reps):
        cfg = scenario_config(args.scenario, runs_dir, f"{args.scenario}-{rep}", args.iterations, args.overrides)
        order = ("flow", "base") if rep % 2 == 0 else ("base", "flow")
        row: dict[str, dict[str, float]] = {}
        tokens: dict[str, list[np.ndarray]] = {}
        for which in order:  # rep 0 runs grpoflow first: it writes the base policy both start from
            if which == "flow":
                steps = grpoflow_iterations(cfg)
                row["flow"] = {k: _median_after_first(steps, k) for k in _FLOW_KEYS}
                row["flow_path"] = _path_medians(run_folder(cfg).root)
                tokens["flow"] = _run_tokens(run_folder(cfg).root, cfg.iterations)
                if base_path is None:  # policy v0 of the first grpoflow run: the base model
                    base_path = str(Path(runs_dir) / "base-v0")
                    shutil.copytree(run_folder(cfg).policy_store().version_path(0), base_path, dirs_exist_ok=True)
                if args.runs_dir is None:
                    shutil.rmtree(run_folder(cfg).root, ignore_errors=True)
            else:
                steps, tokens["base"] = baseline_iterations(cfg, base_path, args.device)
                row["base"] = {k: _median_after_first(steps, k) for k in _BASE_KEYS}
        row["ratio"] = {"flow_over_base": row["flow"]["step_window_seconds"] / row["base"]["iteration_seconds"]}
        # The same work: the rows each step generated, compared (after step 0 the two policies differ
        # by float summation order alone, so a row differs only where a uniform falls that close to
        # a boundary of its token's cdf).
        row["same_rows"] = [float(np.mean(np.all(f == b, axis=1))) for f, b in zip(tokens["flow"], tokens["base"])]
        reps.append(row)
        print(f"rep {rep}: grpoflow {row['flow']['step_window_seconds']:.3f} s/it, "
              f"baseline {row['base']['iteration_seconds']:.3f} s/it, ratio {row['ratio']['flow_over_base']:.2f}; "
              f"rows the same in both, by step: {', '.join(f'{x:.0%}' for x in row['same_rows'])}", flush=True)
    return reps, cfg


def _run_tokens(run_dir: str, iterations: int) -> list[np.ndarray]:
    """The completion tokens [rows, max_new_tokens] the run stored for each step."""
    store = RolloutStore(Path(run_dir) / "rollouts.zarr")
    return [store.read(step, "tokens")["tokens"] for step in range(iterations)]


def _path_medians(run_dir: str) -> dict[str, float]:
    """Medians over the run's steps (the first dropped) of its window's parts
    (benchmarks/critical_path.py); empty when its steps overlap."""
    return medians(run_parts(run_dir, skip=1)[0])


def _report(scenario: str, reps: list[dict], overlapping: bool = False) -> None:
    med = {w: {k: statistics.median(r[w][k] for r in reps) for k in reps[0][w]} for w in ("flow", "base")}
    ratios = [r["ratio"]["flow_over_base"] for r in reps]
    f, b = med["flow"], med["base"]
    compute = sum(0.0 if np.isnan(f[k]) else f[k]  # nan: no reference pass (kl_beta 0)
                  for k in ("rollout_compute_seconds", "reference_compute_seconds", "train_step_seconds"))
    print(f"\n{scenario}: medians over {len(reps)} reps")
    print(f"grpoflow / baseline iteration seconds: {statistics.median(ratios):.2f} "
          f"(per rep {', '.join(f'{x:.2f}' for x in ratios)})")
    print("grpoflow: " + ", ".join(f"{k} {v:.3f}" for k, v in f.items()))
    if overlapping:  # generation runs beside training: their compute seconds add up past the step
        print("grpoflow outside compute: not defined with rollout.max_staleness >= 1 (the stages overlap)")
    else:
        print(f"grpoflow outside rollout/reference/train compute: {1 - compute / f['step_window_seconds']:.1%}")
    print("baseline: " + ", ".join(f"{k} {v:.3f}" for k, v in b.items()))
    same = [statistics.median(r["same_rows"][k] for r in reps) for k in range(len(reps[0]["same_rows"]))]
    print(f"rows the same in both, by step (median over the reps): {', '.join(f'{x:.0%}' for x in same)}")
    # MFU: the run's (its step metrics, over its iteration seconds) and the loop's, both against the
    # matmul rate the run measured on this host with every core (stages/perf).
    print(f"MFU (model FLOPs / (seconds x {f['matmul_flops_per_s'] / 1e9:.1f} GFLOP/s)): grpoflow {f['mfu']:.1%} "
          f"of its iteration, rollout {f['mfu_rollout']:.1%}, train {f['mfu_train']:.1%}; baseline "
          f"{b['model_flops'] / b['iteration_seconds'] / f['matmul_flops_per_s']:.1%}")
    path = medians(dict(enumerate(r["flow_path"] for r in reps if r.get("flow_path"))))
    if path:  # where grpoflow's window goes, median over the reps of each rep's median
        print("grpoflow step window by part (ms; benchmarks/critical_path.py, indented: within the part above):")
        for key, label, indent in [*PARTS, ("window", "window", 0)]:
            if key in path:
                print(f"  {'  ' * indent}{label}: {path[key] * 1e3:.1f}")


if __name__ == "__main__":
    main()
