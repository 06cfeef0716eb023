"""What lives inside a worker process between tasks, in one place.

A Dask worker runs many tasks of a run; what must outlive a task is held by this process's
:class:`WorkerState` (:func:`state`), keyed by run or engine:

- ``ranks``: the training rank of each run (stages/train/engine.py ``TrainRank``: model shards,
  optimiser state, process groups), built by ``init_train_rank`` once per run;
- ``engines``: rollout engines behind the contract (stages/rollout/contract.py), by engine name,
  each holding one policy version (the native engine, or a vLLM server process it drives);
- ``codecs``: text codecs, keyed by the bytes of the tokenizer files they are read from, and
  ``sources``: opened prompt sources, keyed by tokenizer, dataset and the state of its files;
- ``senders`` and ``streams``: the weight-sync endpoints of each run (a training rank's sender, an
  engine's receiving thread; flows/weight_sync.py);

and the thread policy (:func:`phase_threads`): how many torch threads a task of each phase takes.

The state lives in an importable module on purpose: a function defined in ``__main__`` or a
notebook is pickled by value with copies of its globals, and state kept there would vanish
between tasks.
"""

from __future__ import annotations

import functools
import logging
import os
from dataclasses import dataclass, field
from typing import Optional

import torch
from distributed import get_worker

from flows.config import GRPOConfig, config_hash
from stages.data import PromptRecord, PromptSource, open_prompt_source
from stages.policy.tokenizer import TextCodec, codec_files_digest, codec_files_stamp
from stages.rollout.contract import PolicyWeights, RolloutEngine
from stages.rollout.engine import EngineConfig, engine_placement
from stages.rollout.native import DraftSpec, NativeEngine
from stages.rollout.vllm_engine import VLLMEngine
from stages.sync import WeightSender
from stages.sync.stream import ReceivedVersion, VersionStream
from stages.train.engine import TrainRank
from storage.policies import PolicyRef
from storage.prompt_files import dataset_stamp

__all__ = ["WorkerState", "state", "phase_threads", "set_threads", "worker_name", "engine_settings", "data_stamp"]


class TaskFailureInOneLine(logging.Filter):
    """Dask's worker logs a failed task as an ERROR holding the task's repr and its traceback. The
    driver raises the same error with that traceback chained (and ``grpoflow run`` writes it to the
    run's error.txt), so on the worker the record is cut to one WARNING line: ``task <key> failed:
    <exception>``. A stateless task that fails and is retried elsewhere still leaves that line."""

    def filter(self, record: logging.LogRecord) -> bool:
        if isinstance(record.msg, str) and record.msg.startswith("Compute Failed") and \
                isinstance(record.args, tuple) and len(record.args) == 5:
            key, _, _, exception, _ = record.args
            record.msg, record.args = "task %s failed: %s", (key, exception)
            record.levelno, record.levelname = logging.WARNING, "WARNING"
        return True


# Installed in every worker process that runs a grpoflow task: its function's module imports this one.
if not any(isinstance(f, TaskFailureInOneLine) for f in logging.getLogger("distributed.worker").filters):
    logging.getLogger("distributed.worker").addFilter(TaskFailureInOneLine())


@dataclass
class WorkerState:
    """This process's long-lived objects (see the module docstring)."""

    ranks: dict[str, TrainRank] = field(default_factory=dict)
    engines: dict[str, tuple[tuple, RolloutEngine]] = field(default_factory=dict)
    """engine name -> (the settings it was built with, the engine)"""
    codecs: dict[tuple[str, bool], TextCodec] = field(default_factory=dict)
    sources: dict[str, PromptSource] = field(default_factory=dict)
    senders: dict[str, Optional[WeightSender]] = field(default_factory=dict)
    """run -> this rank's weight sender (None: its channel failed; disk until it reopens)"""
    streams: dict[str, VersionStream] = field(default_factory=dict)
    """run -> this engine's receiving thread"""

    # -- training ranks -------------------------------------------------------------------------------
    def rank(self, run_name: str) -> TrainRank:
        if run_name not in self.ranks:
            raise RuntimeError(f"this worker holds no training rank of run {run_name!r}; was init_train_rank run?")
        return self.ranks[run_name]

    def drop_rank(self, run_name: str) -> bool:
        """Close the run's weight-sync endpoints and its training rank; whether there was one."""
        self.close_endpoints(run_name)
        rank = self.ranks.pop(run_name, None)
        if rank is not None:
            rank.close()
        return rank is not None

    # -- rollout engines ------------------------------------------------------------------------------
    def engine(self, cfg: GRPOConfig, name: str, max_model_len: int | None = None, num_rows: int | None = None,
               max_num_seqs: int | None = None) -> RolloutEngine:
        """The engine ``name`` of this process, built for the run's rollout settings (built anew,
        the old one closed, when another run on a live cluster asks for other settings).
        ``max_model_len`` (default: the step's prompt width + rollout.max_new_tokens), ``num_rows``
        (default: an engine's share of a step) and ``max_num_seqs`` (default rollout.max_num_seqs)
        size its sequences."""
        max_model_len = max_model_len or cfg.max_model_len
        num_rows = num_rows or -(-cfg.task.prompts_per_step // cfg.rollout.num_engines) * cfg.rollout.group_size
        max_num_seqs = max_num_seqs or cfg.rollout.max_num_seqs
        settings = (*engine_settings(cfg), max_model_len, num_rows, max_num_seqs)
        held = self.engines.get(name)
        if held is not None and held[0] == settings:
            return held[1]
        if held is not None:
            held[1].close()
        engine = RolloutEngine(_backend(cfg, max_model_len, num_rows, max_num_seqs))
        self.engines[name] = (settings, engine)
        return engine

    def engine_at(self, cfg: GRPOConfig, name: str, policy: PolicyRef) -> tuple[RolloutEngine, dict]:
        """Engine ``name`` holding ``policy``: the version already held (the same bytes), else the
        copy this process received in memory (cluster.weight_sync=memory), else the published
        folder. Also returns where the weights came from and what it cost (step metrics)."""
        engine = self.engine(cfg, name)
        if engine.version is not None and engine.holds(policy.sha256):
            return engine, engine.load(PolicyWeights(policy.version, policy.path, policy.sha256))
        received, why = self.received(cfg, policy.version)
        if received is None:
            load = engine.load(PolicyWeights(policy.version, policy.path, policy.sha256))
            return engine, {**load, "weight_load_disk_seconds": load["weight_load_seconds"],
                            "weights_not_in_memory": why}
        # The version tag: the version the sync's header carried.
        load = engine.load(PolicyWeights(received.tag.version, policy.path, policy.sha256, received.tensors,
                                         received.tag.content_hash))
        return engine, {**load, "weight_sync_memory_load_seconds": load["weight_load_seconds"],
                        "weight_sync_memory_receive_seconds": received.stats.seconds + received.copy_seconds,
                        "weight_sync_memory_receive_bytes": received.stats.num_bytes,
                        "weights_content_hash": received.tag.content_hash}

    def close_engines(self) -> int:
        """Close every engine of this process (a vLLM server process with it); how many."""
        for _, engine in self.engines.values():
            engine.close()
        count, self.engines = len(self.engines), {}
        return count

    # -- codecs and prompts ---------------------------------------------------------------------------
    def codec(self, cfg: GRPOConfig, policy_path: str) -> TextCodec:
        """The run's text codec, keyed by the bytes of the files it is read from: every version of a
        run carries the same tokenizer, so it is parsed once per worker, not once per version, and
        a run folder made again with another tokenizer (a notebook on a live cluster) gets a codec
        of its own instead of the one cached under the same path."""
        key = (_tokenizer_digest(policy_path), cfg.dataset.chat_template, cfg.dataset.system_prompt)
        if key not in self.codecs:
            self.codecs[key] = TextCodec.from_policy_folder(policy_path, cfg.dataset.chat_template,
                                                            cfg.dataset.system_prompt)
        return self.codecs[key]

    def records(self, cfg: GRPOConfig, policy_path: str, step: int, first: int, stop: int,
                stamp: str | None = None, round: int = 0) -> list[PromptRecord]:
        """Prompts [first, stop) of the step (of its extra round ``round``: rollout.dynamic_sampling).
        The source tokenises its data once per worker, tokenizer and state of the data's files (one
        edited between two runs on a live cluster is read again): ``stamp``, the step's
        :func:`data_stamp`, or taken here when the step has none (a step stored before steps
        recorded it)."""
        key = config_hash({"tokenizer": _tokenizer_digest(policy_path), "dataset": cfg.dataset,
                           "files": stamp or data_stamp(cfg), "prompts_per_step": cfg.task.prompts_per_step})
        if key not in self.sources:
            self.sources[key] = open_prompt_source(cfg.dataset, self.codec(cfg, policy_path), cfg.task.prompts_per_step)
        return self.sources[key].records(step, round)[first:stop]

    # -- weight-sync endpoints ------------------------------------------------------------------------
    def received(self, cfg: GRPOConfig, version: int) -> tuple[ReceivedVersion | None, str]:
        """Policy ``version`` as this engine's process received it, or None and why (then it is
        loaded from its folder)."""
        if cfg.cluster.weight_sync != "memory":
            return None, "cluster.weight_sync=disk"
        stream = self.streams.get(cfg.run_name)
        if stream is None:
            return None, "this engine process holds no channel"
        return stream.take(version, cfg.cluster.weight_sync_timeout_s)

    def close_endpoints(self, run_name: str) -> None:
        """Close this process's sender and receiving thread of the run, if any."""
        sender = self.senders.pop(run_name, None)
        if sender is not None:
            sender.close()
        stream = self.streams.pop(run_name, None)
        if stream is not None:
            stream.close()


_STATE = WorkerState()


def state() -> WorkerState:
    """This process's :class:`WorkerState`."""
    return _STATE


def engine_settings(cfg: GRPOConfig) -> tuple:
    """What an engine is built with: another value builds a new engine."""
    r = cfg.rollout
    return (r.engine, r.device, r.dtype, r.page_size, r.draft_layers, r.draft_path, r.draft_tokens, r.vllm_python, r.vllm_kv_cache_bytes, r.vllm_timeout_s, phase_threads(cfg, "rollout"))


def _backend(cfg: GRPOConfig, max_model_len: int, num_rows: int, max_num_seqs: int):
    r = cfg.rollout
    device, dtype = engine_placement(r.device, r.dtype)
    if r.engine == "vllm":
        return VLLMEngine(python=r.vllm_python, threads=phase_threads(cfg, "rollout"), dtype=dtype,
                          max_model_len=max_model_len, max_num_seqs=max_num_seqs,
                          kv_cache_bytes=r.vllm_kv_cache_bytes, kv_cache_seqs=num_rows, timeout_s=r.vllm_timeout_s)
    return NativeEngine(device, dtype, EngineConfig(page_size=r.page_size, max_num_seqs=max_num_seqs),
                        DraftSpec(r.draft_layers, r.draft_path, r.draft_tokens))


def _tokenizer_digest(policy_path: str) -> str:
    """:func:`codec_files_digest` of a version folder; its files are read again only once their
    stamp (inode, size, mtime) changes."""
    return _digest_of(policy_path, codec_files_stamp(policy_path))


@functools.lru_cache(maxsize=64)
def _digest_of(policy_path: str, stamp: tuple) -> str:
    return codec_files_digest(policy_path)


def data_stamp(cfg: GRPOConfig) -> str:
    """A digest of the state of the prompt data's files (:func:`~storage.prompt_files.dataset_stamp`: path,
    inode, size and mtime of each), taken by the driver as it makes a step and stored with the step:
    a folder of many files is walked once a step, not once a task."""
    return config_hash({"files": dataset_stamp(cfg.dataset)})


def worker_name(default: str) -> str:
    """The Dask worker running this task, ``default`` outside one (a direct call)."""
    try:
        return str(get_worker().name)
    except ValueError:
        return default


# -- threads ------------------------------------------------------------------------------------------
def phase_threads(cfg: GRPOConfig, phase: str, cores: int | None = None) -> int:
    """Torch threads of one task of ``phase``: "rollout", "train" (training, reference and proximal
    passes) or anything else (reward scoring and IO: Python work that intra-op threads do not
    speed up, 1). cluster.rollout_threads / train_threads > 0 fix the count. Auto (0): the host's
    cores divided by the workers busy at that time. In the synchronous loop the training ranks wait
    while the engines generate and the engines wait while the ranks train, so each phase shares
    the cores among its own workers; with steps overlapping (rollout.max_staleness >= 1) both pools
    run at once and share them. Deterministic for a given host and config, so two runs of one
    config on one machine compute with the same thread counts. A vLLM engine's server process
    takes the rollout count once, when it starts."""
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


def set_threads(cfg: GRPOConfig | None = None, phase: str = "") -> None:
    """Set this worker's torch threads for a task of ``phase`` (:func:`phase_threads`)."""
    n = 1 if cfg is None else phase_threads(cfg, phase)
    if torch.get_num_threads() != n:
        torch.set_num_threads(n)
