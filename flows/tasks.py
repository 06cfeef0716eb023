"""The functions Dask runs on workers: load from storage, call a stage, save to storage.

Long-lived state (training ranks, the rollout engine's loaded policy) is kept in this module's
registries, one per worker process, so it survives between tasks. The functions live in an
importable module on purpose: a function defined in ``__main__`` or a notebook is pickled by value
with copies of its globals, and state kept there would vanish between tasks.
"""

from __future__ import annotations

import functools
import os
import time
from typing import Callable

import numpy as np
import torch
from distributed import get_worker

from flows import weight_sync
from flows.schema import GRPOConfig, config_hash
from stages.advantage import normalize_advantages
from stages.data import PromptRecord, PromptSource, dataset_stamp, open_prompt_source
from stages.policy import DecoderConfig, build_stage, load_hf_state
from stages.policy.tokenizer import TextCodec, codec_files_digest, codec_files_stamp
from stages.rollout.engine import FINISH_LENGTH, engine_placement
from stages.rollout.dynamic import fill_informative_groups
from stages.rollout.rows import generate_rows
from stages.rollout.speculative import draft_from_target
from stages.steps import reward_statistics, score_rows, tiny_base_policy, tiny_max_positions, train_setup
from stages.train.batch import build_global_batch
from stages.train.engine import InjectedFault, TrainRank, rank_tensor_names
from stages.train.schedule import lr_at
from stages.train.timeline import chrome_events
from storage.policies import PolicyRef, PolicyStore, load_model_folder
from storage.rollouts import RolloutStore, StepLayout, StepRef
from storage.run_folder import RunFolder

__all__ = [
    "TRAIN_FAULT_ENV", "exit_with_parent", "worker_ready", "make_base_policy", "init_train_rank",
    "shutdown_train_rank", "mark_stage_complete", "run_and_mark", "rollout_task", "SCORED", "score_task",
    "mark_scored", "reference_task", "proximal_task", "advantage_task", "train_task", "publish_task", "phase_threads",
]

# Worker-process registries (see the module docstring).
_TRAIN_RANKS: dict[str, TrainRank] = {}
_ROLLOUT_MODELS: dict[str, tuple[str, torch.nn.Module, TextCodec]] = {}
# engine key -> (the policy's sha256, or the draft folder, it was made for; the speculative draft)
_ROLLOUT_DRAFTS: dict[str, tuple[str, torch.nn.Module]] = {}
_ROLLOUT_VERSIONS: dict[str, int] = {}  # engine -> the policy version its model holds (the version tag)
_CODECS: dict[tuple[str, bool], TextCodec] = {}  # (the codec files' digest, chat template) -> codec
_SOURCES: dict[str, PromptSource] = {}


def phase_threads(cfg: GRPOConfig, phase: str, cores: int | None = None) -> int:
    """Torch threads of one task of ``phase``: "rollout", "train" (training, reference and proximal
    passes) or anything else (reward scoring and IO: Python work that intra-op threads do not
    speed up, 1). cluster.rollout_threads / train_threads > 0 fix the count. Auto (0): the host's
    cores divided by the workers busy at that time. In the synchronous loop the training ranks wait
    while the engines generate and the engines wait while the ranks train, so each phase shares
    the cores among its own workers; with steps overlapping (rollout.max_staleness >= 1) both pools
    run at once and share them. Deterministic for a given host and config, so two runs of one
    config on one machine compute with the same thread counts."""
    if phase not in ("rollout", "train"):
        return 1
    fixed = cfg.cluster.rollout_threads if phase == "rollout" else cfg.cluster.train_threads
    if fixed > 0:
        return fixed
    cores = cores or len(os.sched_getaffinity(0))
    engines, ranks = cfg.rollout.num_engines, cfg.train.world_size
    if cfg.rollout.max_staleness >= 1:
        # Colocated, a rank without an engine may run its share of a pass while another worker
        # generates; decoupled, both pools run at once.
        busy = max(engines, ranks) if cfg.cluster.placement == "colocated" else engines + ranks
    elif cfg.cluster.placement == "colocated":  # the engines live in the first min(engines, ranks) workers
        busy = min(engines, ranks) if phase == "rollout" else ranks
    else:
        busy = engines if phase == "rollout" else ranks
    return max(1, cores // max(busy, 1))


def _threads(cfg: GRPOConfig | None = None, phase: str = "") -> None:
    """Set this worker's torch threads for a task of ``phase`` (:func:`phase_threads`)."""
    n = 1 if cfg is None else phase_threads(cfg, phase)
    if torch.get_num_threads() != n:
        torch.set_num_threads(n)


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
    _threads()
    return True


def _tokenizer_digest(policy_path: str) -> str:
    """:func:`codec_files_digest` of a version folder; its files are read again only once their
    stamp (inode, size, mtime) changes."""
    return _digest_of(policy_path, codec_files_stamp(policy_path))


@functools.lru_cache(maxsize=64)
def _digest_of(policy_path: str, stamp: tuple) -> str:
    return codec_files_digest(policy_path)


def _codec(cfg: GRPOConfig, policy_path: str) -> TextCodec:
    """The run's text codec, keyed by the bytes of the files it is read from: every version of a run
    carries the same tokenizer, so it is parsed once per worker, not once per version, and a run
    folder deleted and made again with another tokenizer (a notebook on a live cluster) gets a
    codec of its own instead of the one cached under the same path."""
    key = (_tokenizer_digest(policy_path), cfg.dataset.chat_template)
    if key not in _CODECS:
        _CODECS[key] = TextCodec.from_policy_folder(policy_path, cfg.dataset.chat_template)
    return _CODECS[key]


def data_stamp(cfg: GRPOConfig) -> str:
    """A digest of the state of the prompt data's files (:func:`~stages.data.dataset_stamp`: path,
    inode, size and mtime of each), taken by the driver as it makes a step and stored with the step:
    a folder of many files is walked once a step, not once a task."""
    return config_hash({"files": dataset_stamp(cfg.dataset)})


def _records(cfg: GRPOConfig, policy_path: str, step: int, first: int, stop: int,
             stamp: str | None = None, round: int = 0) -> list[PromptRecord]:
    """Prompts [first, stop) of the step (of its extra round ``round``: rollout.dynamic_sampling).
    The source tokenises its data once per worker, tokenizer (the same in every version of a run)
    and state of the data's files (one edited between two runs on a live cluster is read again):
    ``stamp``, the step's :func:`data_stamp`, or taken here when the step has none (a step stored
    before steps recorded it)."""
    key = config_hash({"tokenizer": _tokenizer_digest(policy_path), "dataset": cfg.dataset,
                       "files": stamp or data_stamp(cfg), "prompts_per_step": cfg.task.prompts_per_step})
    if key not in _SOURCES:
        _SOURCES[key] = open_prompt_source(cfg.dataset, _codec(cfg, policy_path), cfg.task.prompts_per_step)
    return _SOURCES[key].records(step, round)[first:stop]


def make_base_policy(cfg: GRPOConfig, folder: RunFolder) -> PolicyRef:
    """Policy v0 of the run: the configured HF folder, or the task's warmed-up tiny model (cached
    across runs in the folder's cache, keyed by everything that determines it)."""
    _threads()
    store = folder.policy_store()
    if cfg.model.path:
        hf_config, tokenizer_json, tensors = load_model_folder(cfg.model.path)
        return store.save_policy(0, hf_config, tokenizer_json, tensors, extra={"source": cfg.model.path},
                                 source=cfg.model.path)
    max_new, digits = cfg.rollout.max_new_tokens, cfg.dataset.num_digits
    key = config_hash({"model": cfg.model, "warmup": cfg.warmup, "task": "addition", "num_digits": digits,
                       "seed": cfg.seed, "max_positions": tiny_max_positions(digits, max_new)})
    cache = PolicyStore(folder.base_policy_cache(key))
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
    _threads(cfg, "train")
    shutdown_train_rank(cfg.run_name)
    hf_config, _, _ = load_model_folder(policy.path, names=set())
    model_cfg = DecoderConfig.from_hf(hf_config)
    setup = train_setup(cfg.train, model_cfg, cfg.num_microbatches, cfg.rollout.temperature, _faults_from_env(),
                        cfg.rollout.max_staleness, cfg.reference_parallel, cfg.logprob_chunk_tokens, cfg.layer_split)
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
    _TRAIN_RANKS[cfg.run_name] = engine
    optim = PolicyStore(os.path.dirname(policy.path)).load_optimizer_state(policy.version, rank)
    if optim is not None:
        engine.load_optimizer_state(optim)
    return rank


def shutdown_train_rank(run_name: str) -> bool:
    weight_sync.close_endpoints(run_name)
    engine = _TRAIN_RANKS.pop(run_name, None)
    if engine is not None:
        engine.close()
    return engine is not None


def _rank(run_name: str) -> TrainRank:
    if run_name not in _TRAIN_RANKS:
        raise RuntimeError(f"this worker holds no training rank of run {run_name!r}; was init_train_rank run?")
    return _TRAIN_RANKS[run_name]


# -- rollout ------------------------------------------------------------------------------------------
def _rollout_model(cfg: GRPOConfig, engine_key: str, policy: PolicyRef) -> tuple[torch.nn.Module, TextCodec, dict]:
    """The engine's model at ``policy``; loads the version if it is not the one held: the weights
    the engine received in memory when it did (cluster.weight_sync = memory), else the published
    folder (flows/weight_sync.py). Also returns where the weights came from and what it cost."""
    held = _ROLLOUT_MODELS.get(engine_key)
    if held is not None and held[0] == policy.sha256:
        # The same bytes (a step whose update left every weight as it was, e.g. all advantages 0):
        # the engine holds this version too.
        _ROLLOUT_VERSIONS[engine_key] = policy.version
        return held[1], held[2], {"weight_load_seconds": 0.0, "weights_from": "held"}
    t0 = time.perf_counter()
    received, why = weight_sync.received_version(cfg, policy.version)
    if received is not None:
        tensors = received.tensors
    else:
        hf_config, _, tensors = load_model_folder(policy.path)
    if held is not None and (received is not None or held[1].cfg == DecoderConfig.from_hf(hf_config)):
        # Into the model the engine holds (a version of the same architecture): no new modules to
        # build and initialise. Half-copied weights belong to no version: a failed load leaves the
        # engine holding none, so the next task loads its version whole instead of using these.
        model, codec = held[1], held[2]
        _ROLLOUT_MODELS.pop(engine_key, None)
        _ROLLOUT_VERSIONS.pop(engine_key, None)
        load_hf_state(model, tensors)
    else:
        if received is not None:  # only the folder's config
            hf_config, _, _ = load_model_folder(policy.path, names=set())
        device, dtype = engine_placement(cfg.rollout.device, cfg.rollout.dtype)
        model = build_stage(DecoderConfig.from_hf(hf_config)).to(device=device, dtype=dtype)
        load_hf_state(model, tensors)  # copies each tensor to the model's device and dtype
        model.eval()
        codec = TextCodec.from_policy_folder(policy.path, cfg.dataset.chat_template)
    # The version tag: the version the sync's header carried, or the folder's.
    _ROLLOUT_MODELS[engine_key] = (policy.sha256, model, codec)
    _ROLLOUT_VERSIONS[engine_key] = received.tag.version if received else policy.version
    load_s = time.perf_counter() - t0
    if received is None:
        return model, codec, {"weight_load_seconds": load_s, "weight_load_disk_seconds": load_s,
                              "weights_from": "disk", "weights_not_in_memory": why}
    return model, codec, {"weight_load_seconds": load_s, "weight_sync_memory_load_seconds": load_s,
                          "weight_sync_memory_receive_seconds": received.stats.seconds + received.copy_seconds,
                          "weight_sync_memory_receive_bytes": received.stats.num_bytes, "weights_from": "memory",
                          "weights_content_hash": received.tag.content_hash}


def _rollout_draft(cfg: GRPOConfig, engine_key: str, model: torch.nn.Module,
                   policy: PolicyRef) -> torch.nn.Module | None:
    """The engine's speculative draft (rollout.draft_layers: the policy's first layers, rebuilt for
    each version the engine holds; rollout.draft_path: another model, loaded once), or None."""
    r = cfg.rollout
    if not (r.draft_layers or r.draft_path):
        return None
    key = policy.sha256 if r.draft_layers else r.draft_path
    held = _ROLLOUT_DRAFTS.get(engine_key)
    if held is not None and held[0] == key:
        return held[1]
    _ROLLOUT_DRAFTS.pop(engine_key, None)
    if r.draft_layers:
        draft = draft_from_target(model, r.draft_layers)
    else:
        hf_config, _, tensors = load_model_folder(r.draft_path)
        p = next(model.parameters())
        draft = build_stage(DecoderConfig.from_hf(hf_config)).to(device=p.device, dtype=p.dtype)
        load_hf_state(draft, tensors)
        draft.eval()
    _ROLLOUT_DRAFTS[engine_key] = (key, draft)
    return draft


def _this_engine(default: str) -> str:
    """The engine a rollout task runs on: its Dask worker's name, whichever engine the range was
    handed to (any engine may take any range, and a process holds one model and one receiving end
    of the weight channel); ``default`` outside a worker."""
    try:
        return str(get_worker().name)
    except ValueError:  # not in a Dask worker: a direct call
        return default


def _check_engine_version(engine_key: str, asked: int) -> None:
    """Refuse to generate a step from any version but the one the step asks for (its group's
    policy_version, set by the rule of flows/async_schedule.py)."""
    held = _ROLLOUT_VERSIONS.get(engine_key)
    if held != asked:
        raise RuntimeError(f"rollout engine {engine_key} holds policy v{held}, the step asks for v{asked}; "
                           "it generates only from the version the step names")


def rollout_task(cfg: GRPOConfig, ref: StepRef, policy: PolicyRef, prompt_start: int, prompt_stop: int,
                 engine_key: str, score: bool = False) -> dict[str, float]:
    """Generate G completions for prompts [prompt_start, prompt_stop) of the step; write their rows.
    ``score`` (reward.in_rollout): score their groups too and write rewards and advantages with them."""
    t_start = time.time()
    _threads(cfg, "rollout")
    engine_key = _this_engine(engine_key)
    store = RolloutStore(ref.root)
    model, codec, load = _rollout_model(cfg, engine_key, policy)
    attrs = store.attrs(ref.step)
    _check_engine_version(engine_key, attrs["policy_version"])
    layout = StepLayout.from_attrs(attrs)
    draft = _rollout_draft(cfg, engine_key, model, policy)

    def generate(round: int, num_prompts: int):
        records = _records(cfg, policy.path, ref.step, prompt_start, prompt_start + num_prompts,
                           attrs.get("data_stamp"), round)
        return records, generate_rows(
            model, codec, [r.prompt_ids for r in records], cfg.rollout, seed=cfg.seed, step=ref.step,
            prompt_start=prompt_start, prompts_per_step=cfg.task.prompts_per_step, prompt_width=layout.prompt_width,
            policy_version=policy.version, round=round, draft=draft)

    records, rows = generate(0, prompt_stop - prompt_start)
    arrays, metrics, scoring = rows.arrays, dict(rows.metrics), {}
    if score:
        reward_s, first_errors = 0.0, []

        def scored(records, rows) -> dict[str, np.ndarray]:
            nonlocal reward_s
            t0 = time.perf_counter()
            scores, first_error = _score(cfg, policy.path, rows.arrays, records)
            reward_s += time.perf_counter() - t0
            first_errors.append(first_error)
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
                   "reward_first_error": next((e for e in first_errors if e), "")}
    store.write_rows(ref.step, arrays, start=rows.row_start)
    return {**metrics, **load, **scoring, "task_start": t_start, "task_end": time.time()}


def mark_stage_complete(ref: StepRef, stage: str | tuple[str, ...], *deps, attrs: dict | None = None):
    """Mark ``stage`` of the step complete (with ``attrs`` on the step group); ``deps`` are the
    tasks that wrote its outputs, so this runs only once they all have. A tuple of stages (one
    task's outputs) is marked in one update. The one place a stage is marked."""
    # The work's measurements go with the mark, so a resumed step whose stage is skipped still
    # reports them (flows/iteration.py); Chrome events stay in timelines/ only.
    results = [_jsonable({k: v for k, v in d.items() if k != "events"}) for d in deps if isinstance(d, dict)]
    stages = (stage,) if isinstance(stage, str) else stage
    RolloutStore(ref.root).mark_complete(ref.step, stages, **(attrs or {}), **{f"results_{s}": results for s in stages})
    return stage


def run_and_mark(fn: Callable, ref: StepRef, stage: str | tuple[str, ...], attrs: dict, *args):
    """``fn(*args)``, the only task of ``stage`` (or the one that writes its outputs, after every
    other task of it has done its share), then the stage's completion mark with its result (as
    :func:`mark_stage_complete` writes it), in the same task. A result that is not a dict of
    measurements (publish's PolicyRef) is marked with the task's start and end instead."""
    t_start = time.time()
    result = fn(*args)
    measured = result if isinstance(result, dict) else {"task_start": t_start, "task_end": time.time()}
    mark_stage_complete(ref, stage, measured, attrs=attrs)
    return result


def _jsonable(value):
    """Plain JSON types (numpy scalars -> float / int, tuples -> lists); floats round-trip exactly."""
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, (bool, np.bool_)):
        return bool(value)
    if isinstance(value, (int, np.integer)):
        return int(value)
    if isinstance(value, (float, np.floating)):
        return float(value)
    return str(value)


# -- reward and advantages ----------------------------------------------------------------------------
SCORED = ("reward", "advantage")
"""The stages a scoring task writes: a range of whole groups holds every reward its advantages need."""


def score_task(cfg: GRPOConfig, ref: StepRef, policy_path: str, start: int, stop: int, *deps) -> dict[str, float]:
    """Score rows [start, stop) (whole groups, chunk-aligned), normalise their groups' advantages,
    and write rewards, failures and advantages in one call: the reward and advantage stages of that
    range. Returns the range's reward statistics (the step's when the range is the whole step)."""
    store = RolloutStore(ref.root)
    rows = store.read(ref.step, "tokens", "length", "finish_reason", start=start, stop=stop)
    G = cfg.rollout.group_size
    stamp = store.attrs(ref.step).get("data_stamp")
    scores, first_error = _score(cfg, policy_path, rows,
                                 _records(cfg, policy_path, ref.step, start // G, stop // G, stamp))
    store.write_rows(ref.step, scores, start=start)
    return {**reward_statistics(scores["reward"], rows["length"], G, scores["reward_failed"], rows["finish_reason"]),
            "reward_first_error": first_error}


def _score(cfg: GRPOConfig, policy_path: str, rows: dict[str, np.ndarray], records: list[PromptRecord]
           ) -> tuple[dict[str, np.ndarray], str]:
    """Rewards, failures and group-normalised advantages of rows holding ``tokens`` and ``length``
    of whole groups, ``records`` their prompts; and why the first failed sample failed ("" if none). The groups are in memory, so their advantages are
    computed there (numpy): the per-group function :func:`advantage_task` maps over the stored
    chunks with dask.array, the same values bit for bit, without a task graph to build (~2 ms a
    call, on every rollout task's path with reward.in_rollout)."""
    scored = score_rows(_codec(cfg, policy_path), rows, records, cfg.rollout.group_size, cfg.reward)
    adv = normalize_advantages(scored.reward, cfg.rollout.group_size, cfg.advantage, ~scored.failed)
    return {"reward": scored.reward, "reward_failed": scored.failed, "advantage": adv}, scored.first_error


def mark_scored(cfg: GRPOConfig, ref: StepRef, *scores: dict, rollout: bool = False) -> dict[str, float]:
    """The gate of several scoring tasks: the step's reward statistics from the stored arrays, and
    the reward and advantage stages marked complete in one update. ``rollout``: ``scores`` are
    rollout tasks that scored their own rows (reward.in_rollout); the rollout stage is marked in
    the same update, with their results."""
    store = RolloutStore(ref.root)
    r = store.read(ref.step, "reward", "length", "reward_failed", "finish_reason")
    stats = reward_statistics(r["reward"], r["length"], cfg.rollout.group_size, r["reward_failed"], r["finish_reason"])
    results = [_jsonable(d) for d in scores]
    by_stage = {"results_rollout": results} if rollout else {}
    store.mark_complete(ref.step, (("rollout",) if rollout else ()) + SCORED, **by_stage, results_reward=results,
                        results_advantage=[_jsonable(stats)])
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


def reference_task(cfg: GRPOConfig, ref: StepRef, *deps) -> dict[str, float]:
    """Forward-only pass of the frozen reference on every training rank (pipelined, or each rank a
    share of the microbatches with train.reference_parallel=data); the rank holding the gathered
    log-probs (last stage, dp = tp = 0) writes ref_logp."""
    t_start = time.time()
    _threads(cfg, "train")
    engine = _rank(cfg.run_name)
    t0 = time.perf_counter()
    store = RolloutStore(ref.root)
    batch = _forward_batch(cfg, store, ref.step, engine.setup.model.pad_token_id or 0)
    logp = engine.batch_logp(batch, "reference_logp")  # every pass, as [N, max_new] in store order
    if logp is not None:
        store.write(ref.step, "ref_logp", logp)
    return {"reference_seconds": time.perf_counter() - t0, "rank": engine.rank, "task_start": t_start,
            "task_end": time.time()}


def proximal_task(cfg: GRPOConfig, ref: StepRef, *deps) -> dict[str, float]:
    """Forward-only pass of the trainer's current weights (before this step's update) on every
    training rank; the output rank writes prox_logp, decoupled PPO's clip anchor."""
    t_start = time.time()
    _threads(cfg, "train")
    engine = _rank(cfg.run_name)
    store = RolloutStore(ref.root)
    batch = _forward_batch(cfg, store, ref.step, engine.setup.model.pad_token_id or 0)
    logp = engine.batch_logp(batch, "proximal_logp")
    if logp is not None:
        store.write(ref.step, "prox_logp", logp)
    return {"proximal_seconds": time.time() - t_start, "rank": engine.rank, "task_start": t_start,
            "task_end": time.time()}


# -- advantages of stored rewards ---------------------------------------------------------------------
def advantage_task(cfg: GRPOConfig, ref: StepRef, *deps) -> dict[str, float]:
    """Group-normalised advantages with dask.array over the stored rewards (chunks of whole
    groups): a step whose rewards a scoring task marked complete without its advantages (a step
    stored before scoring tasks wrote both)."""
    store = RolloutStore(ref.root)
    valid = ~store.dask_array(ref.step, "reward_failed")  # failed rewards: out of their group's statistics
    adv = normalize_advantages(store.dask_array(ref.step, "reward"), cfg.rollout.group_size, cfg.advantage, valid)
    store.write_dask(ref.step, "advantage", adv)
    r = store.read(ref.step, "reward", "length", "reward_failed", "finish_reason")
    return reward_statistics(r["reward"], r["length"], cfg.rollout.group_size, r["reward_failed"], r["finish_reason"])


# -- training and publication -------------------------------------------------------------------------
def train_task(cfg: GRPOConfig, ref: StepRef, folder: RunFolder, new_version: int, with_reference: bool,
               *deps) -> dict:
    """One optimiser step on this rank, then write this rank's shard of the new policy version.
    ``with_reference`` (train.reference_pass = fused): run the reference pass over the step's batch
    first (its log-probs go straight into the batch); the output rank stores them and returns the
    pass's measurements under ``reference``, which publish marks complete before train (the stages
    before it are marked beside this task: :func:`publish_task`)."""
    t_start = time.time()
    _threads(cfg, "train")
    engine = _rank(cfg.run_name)
    store = RolloutStore(ref.root)
    a = _read_sequences(store, ref.step, proximal="proximal" in store.completed(ref.step),
                        reference=cfg.train.uses_reference and not with_reference)
    batch = build_global_batch(a, cfg.train.loss_aggregation, engine.setup.model.pad_token_id or 0,
                               cfg.microbatch_layout, reward_failed=a["reward_failed"],
                               group_size=cfg.rollout.group_size,
                               untrained=a["finish_reason"] == FINISH_LENGTH if cfg.train.overlong == "mask" else None)
    engine.set_lr(lr_at(cfg.train, ref.step, cfg.iterations))  # of the step alone: a resume matches
    fused = {}
    if with_reference:
        result, ref_logp = engine.train_step_with_reference(batch)
        fused = {"reference_seconds": result.metrics["reference_seconds"]}
        if ref_logp is not None:
            store.write(ref.step, "ref_logp", ref_logp)
            fused["reference"] = {"reference_seconds": fused["reference_seconds"], "rank": engine.rank,
                                  "task_start": t_start, "task_end": time.time()}
    else:
        result = engine.train_step(batch)
    t0 = time.perf_counter()
    layout, coord = engine.layout, engine.coord
    num_bytes, state = 0, None
    if coord.dp == 0 and coord.tp == 0:  # one writer per pipeline rank; hf_state gathers TP shards
        state = engine.hf_state()
        num_bytes = folder.policy_store().save_shard(new_version, coord.pp, layout.pp, state)
    elif layout.tp > 1 and coord.dp == 0:
        engine.hf_state()  # a collective over the TP group: its other ranks take part
    # Each rank's optimiser state goes beside the shards, before publish writes the manifest.
    folder.policy_store().save_optimizer_state(new_version, engine.rank, engine.optimizer_state())
    shard_s = time.perf_counter() - t0
    sync = weight_sync.send_version(cfg.run_name, state, new_version)  # {} unless weight_sync=memory
    return {"rank": engine.rank, "metrics": result.metrics, "window_ns": result.window_ns,
            "events": chrome_events(engine.rank, result.actions, result.window_ns, origin_ns=0),
            "shard_bytes": num_bytes, "shard_seconds": shard_s, **sync, **fused,
            "task_start": t_start, "task_end": time.time()}


def publish_task(folder: RunFolder, ref: StepRef, new_version: int, base: PolicyRef, num_shards: int,
                 train_attrs: dict | None, trains: tuple[dict, ...], *after) -> PolicyRef:
    """Finish the new policy version once every pipeline rank's shard is written. ``trains``: the
    training tasks' results when they ran in this attempt; their stage is marked complete here
    first, with ``train_attrs`` (one task fewer between the ranks' step and the next rollout).
    ``after``: tasks that mark the step's earlier stages, so train is never marked before them."""
    if trains:
        fused = [t["reference"] for t in trains if "reference" in t]
        if fused:  # train.reference_pass = fused: the output rank's train task ran and stored the pass
            mark_stage_complete(ref, "reference", *fused)
        mark_stage_complete(ref, "train", *({k: v for k, v in t.items() if k != "reference"} for t in trains),
                            attrs=train_attrs)
    hf_config, tokenizer_json, _ = load_model_folder(base.path, names=set())
    return folder.policy_store().finalize_policy(new_version, hf_config, tokenizer_json, num_shards,
                                                 extra={"step": ref.step}, source=base.path)
