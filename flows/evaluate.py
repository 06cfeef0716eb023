"""Held-out evaluation of policy versions: load -> generate -> score -> metrics -> save.

:func:`evaluate_version` is the eval stage's task. It runs on an eval worker (the driver submits it
once the version is published; :func:`eval_workers` says where it runs without one) or in the
calling process (``grpoflow eval``), on an engine of its own (the process's ``eval`` engine, of the
run's rollout.engine kind; flows/worker.py) with its own seeds: the rollout engines, their held
versions and every training array stay as they would be without it (tests/flows/test_eval.py checks
a run with eval on against one without, bit for bit).
"""

from __future__ import annotations

import logging
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
from distributed import Client, Future, get_worker

from flows.cluster import Pools
from flows.config import GRPOConfig, config_hash
from stages.data import DatasetConfig
from stages.data.readers import read_records
from stages.data.source import FilePromptSource, PromptRecord
from stages.eval import eval_metrics, final_answer
from flows.worker import state
from stages.policy.tokenizer import TextCodec
from stages.reward import score_samples
from stages.rollout.contract import PolicyWeights, RolloutEngine
from stages.rollout.engine import FINISH_LENGTH, RolloutBatch, SamplingParams
from stages.rollout.rows import cut_at_stop_strings
from stages.reward.rows import decode_completions
from storage.files import file_sha256
from storage.policies import PolicyRef
from storage.run_folder import RunFolder

__all__ = ["eval_config_hash", "eval_dataset", "eval_records", "evaluate_version", "eval_workers", "EvalScheduler", "format_eval",
           "load_eval_results", "policy_folder"]

log = logging.getLogger(__name__)

_SEED_MUL = 1_000_003  # seed mix of (eval.seed, version), as the rollout's
_EVAL_PRIORITY = -10  # Dask priority: below every task of a step (0)


def eval_config_hash(cfg: GRPOConfig) -> str:
    """What an evaluation's rows depend on besides the weights: the eval, sampling and reward
    settings and the bytes of the held-out file. Stored metrics under another hash are computed again."""
    data = file_sha256(cfg.eval.path) if cfg.eval.enabled else ""
    return config_hash({"eval": cfg.eval, "rollout": replace(cfg.rollout, max_staleness=0, num_engines=1),
                        "reward": cfg.reward, "chat_template": cfg.dataset.chat_template, "data": data})


def eval_dataset(cfg: GRPOConfig) -> DatasetConfig:
    """The held-out file as a dataset config (file order, the run's chat template)."""
    e = cfg.eval
    kind = "parquet" if str(e.path).endswith(".parquet") else "jsonl"
    return DatasetConfig(kind=kind, path=e.path, prompt_field=e.prompt_field, answer_field=e.answer_field,
                         shuffle=False, chat_template=cfg.dataset.chat_template)


def eval_records(cfg: GRPOConfig, codec: TextCodec) -> list[PromptRecord]:
    """The held-out records, in file order (the first eval.num_prompts)."""
    dataset = eval_dataset(cfg)
    raw = read_records(dataset)
    raw = raw[: cfg.eval.num_prompts] if cfg.eval.num_prompts else raw
    return FilePromptSource(dataset, codec, len(raw), raw).records(0)


def _generate(engine: RolloutEngine, codec: TextCodec, records: list[PromptRecord], cfg: GRPOConfig, n: int,
              greedy: bool, version: int) -> RolloutBatch:
    r, e = cfg.rollout, cfg.eval
    # Greedy: only the most likely token is kept (top_k = 1), so the draw is the argmax.
    params = SamplingParams(n, e.max_new_tokens or r.max_new_tokens, 1.0 if greedy else r.temperature,
                            1.0 if greedy else r.top_p, tuple(codec.eos_ids), codec.pad_id, top_k=1 if greedy else r.top_k)
    batch = engine.generate(version, [list(rec.prompt_ids) for rec in records], params, e.seed * _SEED_MUL + version)
    return cut_at_stop_strings(batch, codec, r.stop)


def evaluate_version(cfg: GRPOConfig, folder: RunFolder, policy: PolicyRef) -> dict[str, float]:
    """Evaluate ``policy`` on the held-out prompts and store its rows and metrics; a version already
    evaluated under the same eval config returns its stored metrics."""
    store, key = folder.eval_store(), eval_config_hash(cfg)
    done = store.metrics(policy.version, key, policy.sha256)
    if done is not None:
        return done
    t0 = time.perf_counter()
    e = cfg.eval
    codec = TextCodec.from_policy_folder(policy.path, cfg.dataset.chat_template, cfg.dataset.system_prompt)
    records = eval_records(cfg, codec)
    # The eval engine of this process: never a rollout engine, whose held version it would change.
    width = max(len(rec.prompt_ids) for rec in records) + (e.max_new_tokens or cfg.rollout.max_new_tokens)
    engine = state().engine(cfg, "eval", max_model_len=width, num_rows=len(records) * max(e.num_samples, 1),
                            max_num_seqs=max(cfg.rollout.max_num_seqs, e.num_samples))
    engine.load(PolicyWeights(policy.version, policy.path, policy.sha256))
    parts, metrics = [], {}
    for greedy, n in ((True, 1), (False, e.num_samples)):
        if (greedy and not e.greedy) or n == 0:
            continue
        batch = _generate(engine, codec, records, cfg, n, greedy, policy.version)
        rows = {"tokens": batch.tokens, "length": batch.length}
        completions = decode_completions(codec, rows)
        scored = score_samples([rec.prompt for rec in records for _ in range(n)], completions,
                               list(e.functions or cfg.reward.functions), cfg.reward.timeout_s,
                               fields=[rec.reward_kwargs() for rec in records for _ in range(n)],
                               memory_limit_bytes=cfg.reward.memory_limit_bytes)
        correct = ~scored.failed & (scored.reward >= e.correct_reward)
        answers = [final_answer(c, e.answer_format) for c in completions]
        metrics.update(eval_metrics(correct.reshape(-1, n), scored.reward, answers, batch.length,
                                    batch.finish_reason == FINISH_LENGTH, e.ks if not greedy else (),
                                    "eval_greedy_" if greedy else "eval_"))
        parts.append({"prompt_index": np.repeat([rec.index for rec in records], n).astype(np.int32),
                      "sample": np.tile(np.arange(n, dtype=np.int32), len(records)),
                      "greedy": np.full(len(completions), greedy), "tokens": batch.tokens, "length": batch.length,
                      "finish_reason": batch.finish_reason, "reward": scored.reward,
                      "reward_failed": scored.failed, "correct": correct})
    width = max(p["tokens"].shape[1] for p in parts)
    for p in parts:  # one width for both kinds of completion
        p["tokens"] = np.pad(p["tokens"], ((0, 0), (0, width - p["tokens"].shape[1])), constant_values=codec.pad_id)
    arrays = {name: np.concatenate([p[name] for p in parts]) for name in parts[0]}
    metrics["eval_seconds"] = time.perf_counter() - t0
    metrics["eval_prompts"] = float(len(records))
    store.save(policy.version, arrays, metrics, key, extra={"policy_sha256": policy.sha256, "worker": _worker_name()})
    return metrics


def eval_workers(pools: Pools) -> tuple[str, ...]:
    """Where evaluations run: the ``eval`` workers (the embedded cluster starts one when eval.path
    is set), else rollout workers that hold no training rank, else the plain workers. A plain worker
    busy evaluating holds back the step's gates (a 45 s eval of SmolLM2 added 40 s to its step), and
    a training worker would hold its rank's next task while the other ranks wait for it in a
    collective (bounded by train.timeout_s), so those come last."""
    apart = tuple(n for n in pools.rollout if n not in pools.train)
    return pools.eval or apart or pools.plain or pools.rollout


def _worker_name() -> str:
    """The Dask worker running this evaluation, or "driver" (grpoflow eval)."""
    try:
        return str(get_worker().name)
    except ValueError:
        return "driver"


class EvalScheduler:
    """The driver's side of the eval stage: submits a version's evaluation when it is due, and
    gathers the metrics (version -> metrics) at the end."""

    def __init__(self, client: Client, cfg: GRPOConfig, folder: RunFolder, pools: Pools):
        self.client, self.cfg, self.folder = client, cfg, folder
        self.workers, self.use_eval_resource = list(eval_workers(pools)), bool(pools.eval)
        self.pending: dict[int, Future] = {}
        self._key = eval_config_hash(cfg) if cfg.eval.enabled else ""

    def published(self, policy: PolicyRef) -> None:
        """Policy ``policy`` is out: evaluate it if eval says so and it has not been (a resumed run)."""
        v = policy.version
        if (not self.cfg.eval.due(v, self.cfg.iterations) or v in self.pending
                or self.folder.eval_store().metrics(v, self._key, policy.sha256) is not None):
            return
        # The eval resource survives a restart of its worker (a name is resolved to an address at
        # submission); elsewhere below the step's own tasks, taken when no step task waits.
        where = {"resources": {"eval": 1}} if self.use_eval_resource else {"workers": self.workers}
        self.pending[v] = self.client.submit(
            evaluate_version, self.cfg, self.folder, policy, priority=_EVAL_PRIORITY, pure=False,
            key=f"eval-v{v}-{self.cfg.run_name}-{time.time_ns()}", **where)

    def catch_up(self, version: int) -> None:
        """Evaluate every due version up to ``version`` (published by this or an earlier process)."""
        store = self.folder.policy_store()
        for v in range(version + 1):
            if self.cfg.eval.due(v, self.cfg.iterations):
                self.published(store.ref(v))

    def gather(self, timeout_s: float) -> dict[int, dict[str, float]]:
        """Metrics of the evaluations this process submitted, by version, all within ``timeout_s``.
        A failed or late one is logged and left out: evaluation never fails the training run;
        ``grpoflow eval`` redoes it."""
        out = {}
        deadline = time.monotonic() + timeout_s
        for version, future in sorted(self.pending.items()):
            try:
                out[version] = future.result(timeout=max(0.0, deadline - time.monotonic()))
            except Exception as exc:
                log.warning("eval of policy v%d failed: %s; run grpoflow eval to redo it", version,
                            str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__)
        self.pending.clear()
        return out


def format_eval(results: dict[int, dict[str, float]]) -> str:
    """One line per evaluated version: accuracy (greedy and sampled) and format rate."""
    lines = []
    for version, m in sorted(results.items()):
        parts = [f"{k.removeprefix('eval_')} {m[k]:.3f}" for k in ("eval_greedy_accuracy", "eval_accuracy",
                                                                   "eval_greedy_format_rate") if k in m]
        lines.append(f"eval v{version}: " + ", ".join(parts))
    return "\n".join(lines)


def load_eval_results(cfg: GRPOConfig, folder: RunFolder) -> dict[int, dict[str, float]]:
    """Metrics of every finished evaluation in the run folder under the run's eval config, by version."""
    return folder.eval_store().all_metrics(eval_config_hash(cfg)) if cfg.eval.enabled else {}


def policy_folder(path: str | Path) -> PolicyRef:
    """A PolicyRef for an HF folder outside a run (the base model of a config): version 0, its
    sha256 a digest of the folder's file names, sizes and modification times (its weights change,
    its stored evaluation is stale)."""
    folder = Path(path)
    stamp = sorted((f.name, f.stat().st_size, f.stat().st_mtime_ns) for f in folder.iterdir() if f.is_file())
    return PolicyRef(str(folder), 0, config_hash({"files": stamp}))
