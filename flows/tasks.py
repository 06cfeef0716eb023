"""The functions Dask runs on workers: load from storage, call a stage, save to storage.

Long-lived state (training ranks, the rollout engine's loaded policy) is kept in this module's
registries, one per worker process, so it survives between tasks. The functions live in an
importable module on purpose: a function defined in ``__main__`` or a notebook is pickled by value
with copies of its globals, and state kept there would vanish between tasks.
"""

from __future__ import annotations

import dataclasses

import os
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from stages.advantage import normalize_advantages
from stages.config import GRPOConfig, config_hash
from stages.policy import DecoderConfig, build_stage, load_hf_state
from stages.policy.tokenizer import TextCodec
from stages.reward import score_samples
from stages.rollout import SamplingParams, generate
from stages.tasks.addition import make_prompts, make_tokenizer_json, warmup_pairs
from stages.train.batch import build_global_batch
from stages.train.engine import InjectedFault, TrainRank, TrainSetup, rank_tensor_names
from stages.train.loss import LossConfig
from stages.train.timeline import chrome_events
from stages.warmup import supervised_warmup
from storage.policies import PolicyRef, PolicyStore, load_model_folder
from storage.rollouts import RolloutStore, StepRef

__all__ = [
    "RunPaths", "make_base_policy", "init_train_rank", "rollout_task", "mark_complete", "score_task",
    "reference_task", "advantage_task", "train_task", "publish_task", "shutdown_train_rank",
]

# Worker-process registries (see the module docstring).
_TRAIN_RANKS: dict[str, TrainRank] = {}
_ROLLOUT_MODELS: dict[str, tuple[str, torch.nn.Module, TextCodec]] = {}
_CODECS: dict[str, TextCodec] = {}


@dataclass(frozen=True)
class RunPaths:
    run_dir: str

    @property
    def rollouts(self) -> str:
        return f"{self.run_dir}/rollouts.zarr"

    @property
    def policies(self) -> str:
        return f"{self.run_dir}/policy"

    @property
    def timelines(self) -> str:
        return f"{self.run_dir}/timelines"


def _threads() -> None:
    torch.set_num_threads(1)


def _codec(policy_path: str) -> TextCodec:
    if policy_path not in _CODECS:
        _CODECS[policy_path] = TextCodec.from_json((Path(policy_path) / "tokenizer.json").read_text())
    return _CODECS[policy_path]


def _decoder_config(cfg: GRPOConfig, codec: TextCodec) -> DecoderConfig:
    shape = cfg.model.shape(codec.vocab_size)
    return DecoderConfig(
        **{f.name: getattr(shape, f.name) for f in dataclasses.fields(shape)}, rope_theta=cfg.model.rope_theta,
        max_position_embeddings=64, bos_token_id=codec.bos_id, eos_token_id=codec.eos_id, pad_token_id=codec.pad_id)


def make_base_policy(cfg: GRPOConfig, paths: RunPaths, cache_dir: str) -> PolicyRef:
    """Policy v0 of the run: the configured HF folder, or the task's warmed-up tiny model (cached
    across runs under ``cache_dir``, keyed by everything that determines it)."""
    _threads()
    store = PolicyStore(paths.policies)
    if cfg.model.path:
        hf_config, tokenizer_json, tensors = load_model_folder(cfg.model.path)
        return store.save_policy(0, hf_config, tokenizer_json, tensors, extra={"source": cfg.model.path})
    key = config_hash({"model": cfg.model, "warmup": cfg.warmup, "task": cfg.task.name,
                       "num_digits": cfg.task.num_digits, "seed": cfg.seed})
    cache = PolicyStore(f"{cache_dir}/base-{key}")
    if not cache.is_complete(0):
        tokenizer_json = make_tokenizer_json()
        codec = TextCodec.from_json(tokenizer_json)
        model_cfg = _decoder_config(cfg, codec)
        pairs = warmup_pairs(cfg.seed, 4096, cfg.task.num_digits)
        w = cfg.warmup
        tensors = supervised_warmup(model_cfg, codec, pairs, w.steps, w.batch_size, w.lr, cfg.seed)
        cache.save_policy(0, model_cfg.to_hf(), tokenizer_json, tensors, extra={"warmup_steps": w.steps})
    hf_config, tokenizer_json, tensors = load_model_folder(cache.version_path(0))
    return store.save_policy(0, hf_config, tokenizer_json, tensors, extra={"source": str(cache.version_path(0))})


# Test-only: "rank=1,kind=raise[,step=0,microbatch=0,seconds=0]" makes that training rank fail
# (stages/train/faults.py); worker processes inherit it from the process that starts the cluster.
TRAIN_FAULT_ENV = "GRPOFLOW_TEST_TRAIN_FAULT"


def _faults_from_env() -> tuple[InjectedFault, ...]:
    spec = os.environ.get(TRAIN_FAULT_ENV, "").strip()
    if not spec:
        return ()
    fields = dict(item.split("=", 1) for item in spec.split(","))
    types = {"rank": int, "kind": str, "step": int, "microbatch": int, "seconds": float}
    return (InjectedFault(**{k: types[k](v) for k, v in fields.items()}),)


def _train_setup(cfg: GRPOConfig, model_cfg: DecoderConfig) -> TrainSetup:
    t = cfg.train
    return TrainSetup(
        model=model_cfg, pipeline_parallel_size=t.pipeline_model_parallel_size,
        num_microbatches=cfg.num_microbatches, schedule=t.schedule,
        virtual_stages=t.virtual_pipeline_model_parallel_size, data_parallel_size=t.data_parallel_size,
        tensor_parallel_size=t.tensor_model_parallel_size, lr=t.lr, weight_decay=t.weight_decay,
        max_grad_norm=t.max_grad_norm,
        loss=LossConfig(t.clip_eps_low, t.clip_eps_high, t.kl_beta, cfg.rollout.temperature),
        logprob_chunk_tokens=t.logprob_chunk_tokens, timeout_s=t.timeout_s, faults=_faults_from_env())


def init_train_rank(cfg: GRPOConfig, rank: int, init_method: str, policy: PolicyRef) -> int:
    """Build this worker's training rank (global rank ``rank`` of the pp x dp x tp mesh) from a policy
    version; it stays for the whole run."""
    _threads()
    shutdown_train_rank(cfg.run_name)
    hf_config, _, _ = load_model_folder(policy.path, names=set())
    model_cfg = DecoderConfig.from_hf(hf_config)
    setup = _train_setup(cfg, model_cfg)
    names = rank_tensor_names(model_cfg, setup.layout, setup.layout.coord(rank).pp)
    _, _, tensors = load_model_folder(policy.path, names=names)
    _TRAIN_RANKS[cfg.run_name] = TrainRank(setup, rank, init_method, tensors)
    return rank


def shutdown_train_rank(run_name: str) -> bool:
    engine = _TRAIN_RANKS.pop(run_name, None)
    if engine is not None:
        engine.close()
    return engine is not None


def _rank(run_name: str) -> TrainRank:
    if run_name not in _TRAIN_RANKS:
        raise RuntimeError(f"this worker holds no training rank of run {run_name!r}; was init_train_rank run?")
    return _TRAIN_RANKS[run_name]


# -- rollout ------------------------------------------------------------------------------------------
def _rollout_model(engine_key: str, policy: PolicyRef) -> tuple[torch.nn.Module, TextCodec, float]:
    """The engine's model at ``policy``; loads the version if it is not the one held (weight sync)."""
    held = _ROLLOUT_MODELS.get(engine_key)
    if held is not None and held[0] == policy.sha256:
        return held[1], held[2], 0.0
    t0 = time.perf_counter()
    hf_config, tokenizer_json, tensors = load_model_folder(policy.path)
    model = build_stage(DecoderConfig.from_hf(hf_config))
    load_hf_state(model, tensors)
    model.eval()
    codec = TextCodec.from_json(tokenizer_json)
    _ROLLOUT_MODELS[engine_key] = (policy.sha256, model, codec)
    return model, codec, time.perf_counter() - t0


def rollout_task(cfg: GRPOConfig, ref: StepRef, policy: PolicyRef, prompt_start: int, prompt_stop: int,
                 engine_key: str) -> dict[str, float]:
    """Generate G completions for prompts [prompt_start, prompt_stop) of the step; write their rows."""
    _threads()
    model, codec, load_s = _rollout_model(engine_key, policy)
    texts = make_prompts(cfg.seed, ref.step, cfg.task.prompts_per_step, cfg.task.num_digits)
    prompts = [[codec.bos_id] + codec.encode(t) for t in texts[prompt_start:prompt_stop]]
    r = cfg.rollout
    params = SamplingParams(r.group_size, r.max_new_tokens, r.temperature, r.top_p, (codec.eos_id,), codec.pad_id)
    gen = torch.Generator().manual_seed(cfg.seed * 1_000_003 + ref.step * 1_009 + prompt_start)
    batch = generate(model, prompts, params, gen)
    store = RolloutStore(ref.root)
    width = store.layout(ref.step).prompt_width
    prompt_ids = np.full((len(batch.prompt_len), width), codec.pad_id, dtype=np.int32)
    prompt_ids[:, : batch.prompt_ids.shape[1]] = batch.prompt_ids
    row0 = prompt_start * r.group_size
    rows = len(batch.length)
    group_id = ref.step * cfg.task.prompts_per_step + prompt_start + np.arange(rows) // r.group_size
    for name, values in (("prompt_ids", prompt_ids), ("prompt_len", batch.prompt_len),
                         ("tokens", batch.tokens), ("length", batch.length),
                         ("behav_logp", batch.behav_logp), ("finish_reason", batch.finish_reason),
                         ("group_id", group_id), ("policy_version", np.full(rows, policy.version))):
        store.write(ref.step, name, values, start=row0)
    return {"rollout_tokens": float(batch.length.sum()), "rollout_seconds": batch.seconds,
            "rollout_tokens_per_s": batch.tokens_per_s, "kv_cache_bytes": float(batch.kv_cache_bytes),
            "weight_load_seconds": load_s}


def mark_complete(ref: StepRef, stage: str, *deps) -> str:
    """Mark ``stage`` of the step complete; ``deps`` are the futures that wrote its outputs."""
    RolloutStore(ref.root).mark_complete(ref.step, stage)
    return stage


# -- reward -------------------------------------------------------------------------------------------
def score_task(cfg: GRPOConfig, ref: StepRef, policy_path: str, start: int, stop: int, *deps) -> dict[str, float]:
    """Score rows [start, stop) (whole groups, chunk-aligned) and write their rewards."""
    codec = _codec(policy_path)
    store = RolloutStore(ref.root)
    a = store.read(ref.step, "prompt_ids", "prompt_len", "tokens", "length", start=start, stop=stop)
    prompts = [codec.decode(a["prompt_ids"][i, : a["prompt_len"][i]].tolist()) for i in range(stop - start)]
    completions = [codec.decode(a["tokens"][i, : a["length"][i]].tolist()) for i in range(stop - start)]
    scored = score_samples(prompts, completions, cfg.reward.functions, cfg.reward.timeout_s)
    store.write(ref.step, "reward", scored.reward, start=start)
    store.write(ref.step, "reward_failed", scored.failed, start=start)
    return {"reward_failed": float(scored.failed.sum())}


# -- reference log-probs ------------------------------------------------------------------------------
def _read_sequences(store: RolloutStore, step: int) -> dict[str, np.ndarray]:
    return store.read(step, "prompt_ids", "prompt_len", "tokens", "length", "behav_logp", "ref_logp",
                      "advantage")


def reference_task(cfg: GRPOConfig, ref: StepRef, *deps) -> dict[str, float]:
    """Forward-only pipeline pass of the frozen reference on every training rank; the rank holding
    the gathered log-probs (last stage, dp = tp = 0) writes ref_logp."""
    _threads()
    engine = _rank(cfg.run_name)
    t0 = time.perf_counter()
    store = RolloutStore(ref.root)
    a = _read_sequences(store, ref.step)
    batch = build_global_batch(a, "token-mean", engine.setup.model.pad_token_id or 0, cfg.microbatch_layout)
    logp = engine.batch_logp(batch, "reference_logp")  # every pass, as [N, max_new] in store order
    if logp is not None:
        store.write(ref.step, "ref_logp", logp)
    return {"reference_seconds": time.perf_counter() - t0}


# -- advantages ---------------------------------------------------------------------------------------
def advantage_task(cfg: GRPOConfig, ref: StepRef, *deps) -> dict[str, float]:
    """Group-normalised advantages with dask.array over the stored rewards (chunks of whole groups)."""
    store = RolloutStore(ref.root)
    adv = normalize_advantages(store.dask_array(ref.step, "reward"), cfg.rollout.group_size, cfg.advantage)
    store.write_dask(ref.step, "advantage", adv)
    store.mark_complete(ref.step, "advantage")
    r = store.read(ref.step, "reward", "length")
    grouped = r["reward"].reshape(-1, cfg.rollout.group_size)
    return {"reward_mean": float(r["reward"].mean()), "reward_std": float(r["reward"].std()),
            "zero_variance_groups": float((grouped.std(axis=1) == 0).sum()),
            "completion_length_mean": float(r["length"].mean())}


# -- training and publication -------------------------------------------------------------------------
def train_task(cfg: GRPOConfig, ref: StepRef, paths: RunPaths, new_version: int, *deps) -> dict:
    """One optimiser step on this rank, then write this rank's shard of the new policy version."""
    _threads()
    engine = _rank(cfg.run_name)
    store = RolloutStore(ref.root)
    a = _read_sequences(store, ref.step)
    batch = build_global_batch(a, cfg.train.loss_aggregation, engine.setup.model.pad_token_id or 0,
                               cfg.microbatch_layout)
    result = engine.train_step(batch)
    t0 = time.perf_counter()
    layout, coord = engine.layout, engine.coord
    num_bytes = 0
    if coord.dp == 0 and coord.tp == 0:  # one writer per pipeline rank; hf_state gathers TP shards
        state = engine.hf_state()
        num_bytes = PolicyStore(paths.policies).save_shard(new_version, coord.pp, layout.pp, state)
    elif layout.tp > 1 and coord.dp == 0:
        engine.hf_state()  # a collective over the TP group: its other ranks take part
    return {"rank": engine.rank, "metrics": result.metrics, "window_ns": result.window_ns,
            "events": chrome_events(engine.rank, result.actions, result.window_ns, origin_ns=0),
            "shard_bytes": num_bytes, "num_shards": layout.pp, "shard_seconds": time.perf_counter() - t0}


def publish_task(paths: RunPaths, new_version: int, base: PolicyRef, step: int, *rank_results) -> PolicyRef:
    """Finish the new policy version once every rank's shard is written."""
    hf_config, tokenizer_json, _ = load_model_folder(base.path, names=set())
    policies = PolicyStore(paths.policies)
    num_shards = max(r["num_shards"] for r in rank_results)
    return policies.finalize_policy(new_version, hf_config, tokenizer_json, num_shards, extra={"step": step})
