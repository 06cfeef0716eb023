"""The functions Dask runs on workers: load from storage, call a stage, save to storage.

What outlives a task in a worker process (training ranks, rollout engines, codecs, prompt
sources, weight-sync endpoints) is held by flows/worker.py; the tasks here fetch it from there.
"""

from __future__ import annotations

import hashlib
import logging
import os
import time
from typing import Callable

import numpy as np
import torch

from flows import weight_sync
from flows.config import GRPOConfig, config_hash
from flows.results import (AdvantageResult, ProximalResult, ReferenceResult, RolloutResult, ScoreResult, TaskResult,
                           TaskSpan, TrainResult)
from flows.worker import data_stamp, phase_threads, set_threads, state, worker_name
from stages.advantage import normalize_advantages
from stages.data import PromptRecord
from stages.policy import DecoderConfig
from stages.rollout.engine import FINISH_LENGTH
from stages.rollout.dynamic import fill_informative_groups
from stages.rollout.rows import generate_rows
from stages.reward import merge_function_stats
from stages.reward.rows import reward_statistics, score_rows
from stages.tasks.tiny_policy import tiny_base_policy, tiny_max_positions
from stages.train.setup import train_setup
from stages.train.batch import build_global_batch
from stages.train.engine import InjectedFault, TrainRank, rank_tensor_names
from stages.train.schedule import lr_at
from stages.train.timeline import chrome_events
from storage.policies import PolicyRef, PolicyStore, PolicyStoreError, load_model_folder
from storage.rollouts import RolloutStore, StepLayout, StepRef
from storage.run_folder import RunFolder

log = logging.getLogger(__name__)

TIED_NAME = "model.embed_tokens.weight"
"""A tied embedding's HF name: the head of the last pipeline stage is this tensor too."""

__all__ = [
    "TRAIN_FAULT_ENV", "exit_with_parent", "worker_ready", "make_base_policy", "init_train_rank",
    "shutdown_train_rank", "close_engines", "mark_stage_complete", "run_and_mark", "rollout_task", "SCORED",
    "score_task", "mark_scored", "reference_task", "proximal_task", "advantage_task", "train_task", "publish_task",
    "phase_threads", "data_stamp",
]


def exit_with_parent(poll_s: float = 0.2) -> int:
    """Make this worker process exit once the process that started it (the driver running an
    embedded cluster) is gone: a killed driver then leaves no worker writing into the run folder
    while a rerun starts. Returns the watched parent's pid."""
    import threading

    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(poll_s)
        os._exit(1)

    threading.Thread(target=watch, name="exit-with-parent", daemon=True).start()
    return parent


def worker_ready() -> bool:
    """Nothing: running it makes a worker import this module (torch, the engines) ahead of use."""
    set_threads()
    return True


def make_base_policy(cfg: GRPOConfig, folder: RunFolder) -> PolicyRef:
    """Policy v0 of the run: the configured HF folder, or the task's warmed-up tiny model (cached
    across runs in the folder's cache, keyed by everything that determines it)."""
    set_threads()
    store = folder.policy_store()
    if cfg.model.path:
        hf_config, tokenizer_json, tensors = load_model_folder(cfg.model.path)
        return store.save_policy(0, hf_config, tokenizer_json, tensors, extra={"source": cfg.model.path},
                                 source=cfg.model.path)
    max_new, digits = cfg.rollout.max_new_tokens, cfg.dataset.num_digits
    key = config_hash({"model": cfg.model, "warmup": cfg.warmup, "task": "addition", "num_digits": digits,
                       "seed": cfg.seed, "max_positions": tiny_max_positions(digits, max_new)})
    cache = PolicyStore(folder.base_policy_cache(key))
    if cache.is_complete(0):
        try:  # verified like a version of the run: a damaged cache is rebuilt (the same bytes)
            cache.verify(0)
        except PolicyStoreError as exc:
            log.warning("rebuilding the base-policy cache: %s", str(exc).splitlines()[0])
            cache.remove_from(0)
    if not cache.is_complete(0):
        tiny = tiny_base_policy(cfg.model, cfg.warmup, digits, max_new, cfg.seed)
        cache.save_policy(0, tiny.hf_config, tiny.tokenizer_json, tiny.tensors,
                          extra={"warmup_steps": cfg.warmup.steps})
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


def init_train_rank(cfg: GRPOConfig, rank: int, init_method: str, policy: PolicyRef,
                    reference: PolicyRef | None = None) -> int:
    """Build this worker's training rank (global rank ``rank`` of the pp x dp x tp mesh) from a policy
    version and the optimiser state saved with it; the frozen reference is ``reference`` (the run's
    v0; default: ``policy``). It stays for the whole run."""
    set_threads(cfg, "train")
    shutdown_train_rank(cfg.run_name)
    hf_config, _, _ = load_model_folder(policy.path, names=set())
    model_cfg = DecoderConfig.from_hf(hf_config)
    setup = train_setup(cfg.train, model_cfg, cfg.num_microbatches, cfg.rollout.temperature, _faults_from_env(),
                        cfg.rollout.max_staleness, cfg.reference_parallel, cfg.logprob_chunk_tokens, cfg.layer_split,
                        cfg.rollout.engine, lr=cfg.lr, engine_dtype=cfg.engine_dtype)
    names = rank_tensor_names(model_cfg, setup.layout, setup.layout.coord(rank).pp, setup.layer_split)
    _, _, tensors = load_model_folder(policy.path, names=names)
    ref_tensors = None
    if not setup.reference:
        pass  # kl_beta 0: the ranks hold no reference
    elif setup.reference_parallel == "data":  # the whole reference on every rank
        _, _, ref_tensors = load_model_folder((reference or policy).path)
    elif reference is not None and reference.path != policy.path:
        _, _, ref_tensors = load_model_folder(reference.path, names=names)
    engine = TrainRank(setup, rank, init_method, tensors, reference_tensors=ref_tensors)
    state().ranks[cfg.run_name] = engine
    optim = PolicyStore(os.path.dirname(policy.path)).load_optimizer_state(policy.version, rank)
    if optim is not None:
        engine.load_optimizer_state(optim)
    return rank


def shutdown_train_rank(run_name: str) -> bool:
    """Close this worker's training rank of the run and its weight-sync endpoints."""
    return state().drop_rank(run_name)


def close_engines() -> int:
    """Close this worker's rollout engines (a vLLM engine's server process with it)."""
    return state().close_engines()


def rollout_task(cfg: GRPOConfig, ref: StepRef, policy: PolicyRef, prompt_start: int, prompt_stop: int,
                 engine_key: str, score: bool = False) -> RolloutResult:
    """Generate G completions for prompts [prompt_start, prompt_stop) of the step; write their rows.
    ``score`` (reward.in_rollout): score their groups too and write rewards and advantages with them."""
    t_start = time.time()
    set_threads(cfg, "rollout")
    # Any engine may take any range: the one of this worker (a process holds one engine and one
    # receiving end of the weight channel).
    worker = state()
    engine, load = worker.engine_at(cfg, worker_name(engine_key), policy)
    codec = worker.codec(cfg, policy.path)
    store = RolloutStore(ref.root)
    attrs = store.attrs(ref.step)
    layout = StepLayout.from_attrs(attrs)

    def generate(round: int, num_prompts: int):
        records = worker.records(cfg, policy.path, ref.step, prompt_start, prompt_start + num_prompts,
                                 attrs.get("data_stamp"), round)
        # The engine generates only from the version the step names (its group's policy_version,
        # set by the rule of flows/async_schedule.py).
        return records, generate_rows(
            engine, codec, [r.prompt_ids for r in records], cfg.rollout, seed=cfg.seed, step=ref.step,
            prompt_start=prompt_start, prompts_per_step=cfg.task.prompts_per_step, prompt_width=layout.prompt_width,
            policy_version=attrs["policy_version"], round=round)

    records, rows = generate(0, prompt_stop - prompt_start)
    arrays, metrics, scoring = rows.arrays, dict(rows.metrics), {}
    if score:
        reward_s, first_errors, by_function = 0.0, [], {}

        def scored(records, rows) -> dict[str, np.ndarray]:
            nonlocal reward_s
            t0 = time.perf_counter()
            scores, first_error, functions = _score(cfg, policy.path, rows.arrays, records)
            reward_s += time.perf_counter() - t0
            first_errors.append(first_error)
            merge_function_stats(by_function, functions)
            return {**rows.arrays, **scores}

        arrays = scored(records, rows)
        if cfg.rollout.dynamic_sampling:
            def extra_round(round: int, num_prompts: int) -> dict[str, np.ndarray]:
                more_records, more = generate(round, num_prompts)
                for key in ("rollout_tokens", "rollout_seconds"):
                    metrics[key] += more.metrics[key]
                metrics["kv_cache_bytes"] = max(metrics["kv_cache_bytes"], more.metrics["kv_cache_bytes"])
                return scored(more_records, more)

            filled = fill_informative_groups(arrays, extra_round, cfg.rollout.group_size,
                                             cfg.rollout.dynamic_sampling_rounds)
            arrays = filled.arrays
            metrics.update(filled.metrics, generated_samples=filled.metrics["groups_generated"] * cfg.rollout.group_size)
            metrics["rollout_tokens_per_s"] = metrics["rollout_tokens"] / max(metrics["rollout_seconds"], 1e-9)
        scoring = {"reward_seconds": reward_s, "reward_failed": float(arrays["reward_failed"].sum()),
                   "reward_first_error": next((e for e in first_errors if e), ""), "reward_functions": by_function}
    store.write_rows(ref.step, arrays, start=rows.row_start)
    return RolloutResult(**metrics, **load, **scoring, task_start=t_start, task_end=time.time())


def mark_stage_complete(ref: StepRef, stage: str | tuple[str, ...], *deps, attrs: dict | None = None):
    """Mark ``stage`` of the step complete (with ``attrs`` on the step group); ``deps`` are the
    tasks that wrote its outputs, so this runs only once they all have. A tuple of stages (one
    task's outputs) is marked in one update. The one place a stage is marked."""
    # The work's measurements go with the mark, so a resumed step whose stage is skipped still
    # reports them (flows/iteration.py); Chrome events stay in timelines/ only.
    results = [d.to_dict() for d in deps if isinstance(d, TaskResult)]
    stages = (stage,) if isinstance(stage, str) else stage
    RolloutStore(ref.root).mark_complete(ref.step, stages, **(attrs or {}), **{f"results_{s}": results for s in stages})
    return stage


def run_and_mark(fn: Callable, ref: StepRef, stage: str | tuple[str, ...], attrs: dict, *args):
    """``fn(*args)``, the only task of ``stage`` (or the one that writes its outputs, after every
    other task of it has done its share), then the stage's completion mark with its result (as
    :func:`mark_stage_complete` writes it), in the same task. A result that is not a
    :class:`TaskResult` (publish's PolicyRef) is marked with the task's start and end instead."""
    t_start = time.time()
    result = fn(*args)
    measured = result if isinstance(result, TaskResult) else TaskSpan(task_start=t_start, task_end=time.time())
    mark_stage_complete(ref, stage, measured, attrs=attrs)
    return result


# -- reward and advantages ----------------------------------------------------------------------------
SCORED = ("reward", "advantage")
"""The stages a scoring task writes: a range of whole groups holds every reward its advantages need."""


def score_task(cfg: GRPOConfig, ref: StepRef, policy_path: str, start: int, stop: int, *deps) -> ScoreResult:
    """Score rows [start, stop) (whole groups, chunk-aligned), normalise their groups' advantages,
    and write rewards, failures and advantages in one call: the reward and advantage stages of that
    range. Returns the range's reward statistics (the step's when the range is the whole step)."""
    store = RolloutStore(ref.root)
    rows = store.read(ref.step, "tokens", "length", "finish_reason", start=start, stop=stop)
    G = cfg.rollout.group_size
    stamp = store.attrs(ref.step).get("data_stamp")
    scores, first_error, functions = _score(cfg, policy_path, rows,
                                            state().records(cfg, policy_path, ref.step, start // G, stop // G, stamp))
    store.write_rows(ref.step, scores, start=start)
    stats = reward_statistics(scores["reward"], rows["length"], G, scores["reward_failed"], rows["finish_reason"])
    return ScoreResult(statistics=stats, reward_first_error=first_error, reward_functions=functions)


def _score(cfg: GRPOConfig, policy_path: str, rows: dict[str, np.ndarray], records: list[PromptRecord]
           ) -> tuple[dict[str, np.ndarray], str, dict[str, dict]]:
    """Rewards, failures and group-normalised advantages of rows holding ``tokens`` and ``length``
    of whole groups, ``records`` their prompts; why the first failed sample failed ("" if none); and
    each function's sums and failures (ScoredGroups.function_metrics). The groups are in memory, so their advantages are
    computed there (numpy): the per-group function :func:`advantage_task` maps over the stored
    chunks with dask.array, the same values bit for bit, without a task graph to build (~2 ms a
    call, on every rollout task's path with reward.in_rollout)."""
    scored = score_rows(state().codec(cfg, policy_path), rows, records, cfg.rollout.group_size, cfg.reward)
    adv = normalize_advantages(scored.reward, cfg.rollout.group_size, cfg.advantage, ~scored.failed)
    return ({"reward": scored.reward, "reward_failed": scored.failed, "advantage": adv}, scored.first_error,
            scored.function_metrics())


def mark_scored(cfg: GRPOConfig, ref: StepRef, *scores: ScoreResult | RolloutResult, rollout: bool = False
                ) -> AdvantageResult:
    """The gate of several scoring tasks: the step's reward statistics from the stored arrays, and
    the reward and advantage stages marked complete in one update. ``rollout``: ``scores`` are
    rollout tasks that scored their own rows (reward.in_rollout); the rollout stage is marked in
    the same update, with their results, and the reward stage with their scoring."""
    store = RolloutStore(ref.root)
    r = store.read(ref.step, "reward", "length", "reward_failed", "finish_reason")
    stats = AdvantageResult(statistics=reward_statistics(r["reward"], r["length"], cfg.rollout.group_size,
                                                         r["reward_failed"], r["finish_reason"]))
    by_stage = {"results_rollout": [d.to_dict() for d in scores]} if rollout else {}
    scored = [d.scores() if isinstance(d, RolloutResult) else d for d in scores]
    store.mark_complete(ref.step, (("rollout",) if rollout else ()) + SCORED, **by_stage,
                        results_reward=[d.to_dict() for d in scored], results_advantage=[stats.to_dict()])
    return stats


# -- reference log-probs ------------------------------------------------------------------------------
def _read_sequences(store: RolloutStore, step: int, proximal: bool = False, reference: bool = True
                    ) -> dict[str, np.ndarray]:
    """The arrays build_global_batch reads; ``proximal``: with prox_logp (decoupled PPO's anchor);
    ``reference`` False: ref_logp not read but zeros (the train task computes it, or nothing reads
    it: kl_beta 0)."""
    a = store.read(step, "prompt_ids", "prompt_len", "tokens", "length", "behav_logp", "advantage", "reward_failed",
                   "finish_reason", *(("ref_logp",) if reference else ()), *(("prox_logp",) if proximal else ()))
    if not reference:
        a["ref_logp"] = np.zeros(a["tokens"].shape, np.float32)
    return a


def _forward_batch(cfg: GRPOConfig, store: RolloutStore, step: int, pad_id: int):
    """The step's batch for a forward-only pass: only the token arrays are read; the loss fields
    of the target (advantages, log-probs) are zeros, as nothing but next_ids is used."""
    a = store.read(step, "prompt_ids", "prompt_len", "tokens", "length")
    zeros = np.zeros(a["tokens"].shape, np.float32)
    a.update(behav_logp=zeros, ref_logp=zeros, advantage=np.zeros(len(a["length"]), np.float32))
    return build_global_batch(a, "token-mean", pad_id, cfg.microbatch_layout)


def reference_task(cfg: GRPOConfig, ref: StepRef, *deps) -> ReferenceResult:
    """Forward-only pass of the frozen reference on every training rank (pipelined, or each rank a
    share of the microbatches with train.reference_parallel=data); the rank holding the gathered
    log-probs (last stage, dp = tp = 0) writes ref_logp."""
    t_start = time.time()
    set_threads(cfg, "train")
    engine = state().rank(cfg.run_name)
    t0 = time.perf_counter()
    store = RolloutStore(ref.root)
    batch = _forward_batch(cfg, store, ref.step, engine.setup.model.pad_token_id or 0)
    logp = engine.batch_logp(batch, "reference_logp")  # every pass, as [N, max_new] in store order
    if logp is not None:
        store.write(ref.step, "ref_logp", logp)
    return ReferenceResult(reference_seconds=time.perf_counter() - t0, rank=engine.rank, task_start=t_start,
                           task_end=time.time())


def proximal_task(cfg: GRPOConfig, ref: StepRef, *deps) -> ProximalResult:
    """Forward-only pass of the trainer's current weights (before this step's update) on every
    training rank; the output rank writes prox_logp, decoupled PPO's clip anchor."""
    t_start = time.time()
    set_threads(cfg, "train")
    engine = state().rank(cfg.run_name)
    store = RolloutStore(ref.root)
    batch = _forward_batch(cfg, store, ref.step, engine.setup.model.pad_token_id or 0)
    logp = engine.batch_logp(batch, "proximal_logp")
    if logp is not None:
        store.write(ref.step, "prox_logp", logp)
    return ProximalResult(proximal_seconds=time.time() - t_start, rank=engine.rank, task_start=t_start,
                          task_end=time.time())


# -- advantages of stored rewards ---------------------------------------------------------------------
def advantage_task(cfg: GRPOConfig, ref: StepRef, *deps) -> AdvantageResult:
    """Group-normalised advantages with dask.array over the stored rewards (chunks of whole
    groups): a step whose rewards a scoring task marked complete without its advantages (a step
    stored before scoring tasks wrote both)."""
    store = RolloutStore(ref.root)
    valid = ~store.dask_array(ref.step, "reward_failed")  # failed rewards: out of their group's statistics
    adv = normalize_advantages(store.dask_array(ref.step, "reward"), cfg.rollout.group_size, cfg.advantage, valid)
    store.write_dask(ref.step, "advantage", adv)
    r = store.read(ref.step, "reward", "length", "reward_failed", "finish_reason")
    return AdvantageResult(statistics=reward_statistics(r["reward"], r["length"], cfg.rollout.group_size,
                                                        r["reward_failed"], r["finish_reason"]))


# -- training and publication -------------------------------------------------------------------------
def train_task(cfg: GRPOConfig, ref: StepRef, folder: RunFolder, new_version: int, with_reference: bool,
               *deps) -> TrainResult:
    """One optimiser step on this rank, then write this rank's shard of the new policy version.
    ``with_reference`` (train.reference_pass = fused): run the reference pass over the step's batch
    first (its log-probs go straight into the batch); the output rank stores them and returns the
    pass's measurements under ``reference``, which publish marks complete before train (the stages
    before it are marked beside this task: :func:`publish_task`)."""
    t_start = time.time()
    set_threads(cfg, "train")
    engine = state().rank(cfg.run_name)
    store = RolloutStore(ref.root)
    a = _read_sequences(store, ref.step, proximal="proximal" in store.completed(ref.step),
                        reference=cfg.train.uses_reference and not with_reference)
    batch = build_global_batch(a, cfg.train.loss_aggregation, engine.setup.model.pad_token_id or 0,
                               cfg.microbatch_layout, reward_failed=a["reward_failed"],
                               group_size=cfg.rollout.group_size,
                               untrained=a["finish_reason"] == FINISH_LENGTH if cfg.train.overlong == "mask" else None)
    engine.set_lr(lr_at(cfg.train, ref.step, cfg.iterations, cfg.lr))  # of the step alone: a resume matches
    fused = {}
    if with_reference:
        result, ref_logp = engine.train_step_with_reference(batch)
        fused = {"reference_seconds": result.metrics["reference_seconds"]}
        if ref_logp is not None:
            store.write(ref.step, "ref_logp", ref_logp)
            fused["reference"] = ReferenceResult(reference_seconds=fused["reference_seconds"], rank=engine.rank,
                                                 task_start=t_start, task_end=time.time())
    else:
        result = engine.train_step(batch)
    t0 = time.perf_counter()
    layout, coord = engine.layout, engine.coord
    num_bytes, shard, tied = 0, None, {}
    if coord.dp == 0 and coord.tp == 0:  # one writer per pipeline rank; hf_state gathers TP shards
        shard = engine.hf_state()
        kept = shard
        if engine.setup.model.tie_word_embeddings and layout.pp > 1 and TIED_NAME in shard:
            # The first and the last stage hold bit-identical copies (the same summed gradient, the
            # same AdamW step): the version stores the first stage's, publish checks the digests agree.
            tied = {"tied_sha256": hashlib.sha256(shard[TIED_NAME].contiguous().view(torch.uint8).numpy()).hexdigest()}
            if not engine.holds_first:
                kept = {k: v for k, v in shard.items() if k != TIED_NAME}
        num_bytes = folder.policy_store().save_shard(new_version, coord.pp, layout.pp, kept)
    elif layout.tp > 1 and coord.dp == 0:
        engine.hf_state()  # a collective over the TP group: its other ranks take part
    # Each rank's optimiser state goes beside the shards, before publish writes the manifest.
    folder.policy_store().save_optimizer_state(new_version, engine.rank, engine.optimizer_state())
    shard_s = time.perf_counter() - t0
    sync = weight_sync.send_version(cfg.run_name, shard, new_version)  # {} unless weight_sync=memory
    return TrainResult(rank=engine.rank, metrics=result.metrics, window_ns=result.window_ns,
                       events=chrome_events(engine.rank, result.actions, result.window_ns, origin_ns=0),
                       shard_bytes=num_bytes, shard_seconds=shard_s, **sync, **fused, **tied,
                       task_start=t_start, task_end=time.time())


def publish_task(folder: RunFolder, ref: StepRef, new_version: int, base: PolicyRef, num_shards: int,
                 train_attrs: dict | None, trains: tuple[TrainResult, ...], *after) -> PolicyRef:
    """Finish the new policy version once every pipeline rank's shard is written. ``trains``: the
    training tasks' results when they ran in this attempt; their stage is marked complete here
    first, with ``train_attrs`` (one task fewer between the ranks' step and the next rollout).
    ``after``: tasks that mark the step's earlier stages, so train is never marked before them."""
    if trains:
        tied = {t.rank: t.tied_sha256 for t in trains if t.tied_sha256 is not None}
        if len(set(tied.values())) > 1:
            copies = ", ".join(f"rank {r}: {sha[:12]}" for r, sha in sorted(tied.items()))
            raise PolicyStoreError(f"policy v{new_version}: the training ranks' copies of the tied embedding differ "
                                   f"(sha256 {copies}); a version stores one copy, so this one is not published")
        fused = [t.reference for t in trains if t.reference is not None]
        if fused:  # train.reference_pass = fused: the output rank's train task ran and stored the pass
            mark_stage_complete(ref, "reference", *fused)
        mark_stage_complete(ref, "train", *trains, attrs=train_attrs)
    hf_config, tokenizer_json, _ = load_model_folder(base.path, names=set())
    return folder.policy_store().finalize_policy(new_version, hf_config, tokenizer_json, num_shards,
                                                 extra={"step": ref.step}, source=base.path)
