"""The GRPO loop: set up the cluster and the training ranks, run the iterations,
record lineage, write the run summary.

Resuming: a run folder that already holds published steps continues after the last one, from the
policy version it published and the optimiser state saved with it, against the run's reference
(policy v0), in the same MLflow parent run; a step left half-done is picked up after its last
complete stage. A folder started with another config is refused (flows/preflight.py), and
``new=True`` starts over in a fresh folder instead (docs/reliability.md).

rollout.max_staleness s: step k generates from version max(0, k - s), which step k - s - 1
publishes (flows/async_schedule.py). Step k is submitted once step k - s - 2 has finished, so up to
s + 2 steps are in flight: while step k - s - 1 runs, step k's tasks wait on its publish task, and
the scheduler starts step k's rollout as soon as the version is out, without a round trip through
the loop (its lineage, the next submission). Steps finish, and are logged, in order. s = 0 is the
synchronous loop: step k generates from the version step k - 1 has just published.

Losing a training worker: the step ends with a WorkerLostError (flows/iteration.py); every rank
then gets a fresh worker process, is rebuilt from the trainer's version (weights and optimiser
state) and the steps in flight are resubmitted, at most cluster.max_restarts times per step. The
stages already marked complete are kept; the others rewrite their rows whole.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np
import psutil
import torch
from distributed import wait
from tqdm.auto import tqdm

from flows import tasks, weight_sync
from flows.background import BackgroundQueue
from flows.evaluate import EvalScheduler, format_eval, load_eval_results
from flows.async_schedule import behaviour_version, released_by, trainer_version
from flows.cluster import (ClusterError, Pools, check_pools, dashboard_link, lost_workers, restart_train_workers,
                           run_on_workers, start_cluster)
from flows.iteration import (STAGES, IterationError, IterationResult, PendingIteration, PendingPolicy, Policy,
                             WorkerLostError, finish_iteration, prepare_step, submit_iteration)
from flows.preflight import preflight
from flows.schema import GRPOConfig, config_hash, config_to_dict
from stages.advantage import trained_samples
from stages.perf import STEP_PHASES, step_mfu_metrics, step_model_flops
from stages.policy.tokenizer import TextCodec
from stages.train.rendezvous import free_port
from storage.host_rates import HOST_RATES_FILE, host_cores, matmul_rate
from storage.lineage import Lineage, StepRun, relocate_artifacts
from storage.plots import save_eval_plot, save_run_plots
from storage.policies import PolicyRef
from storage.run_folder import RunFolder
from storage.samples import load_sample_table

__all__ = ["RunSummary", "run", "run_folder", "tracking_uri", "format_summary", "remaining_steps", "fresh_run"]

log = logging.getLogger(__name__)
_EXTRA_STAGES = ("proximal",)  # stages only some runs have (rollout.max_staleness >= 1)


@dataclass
class RunSummary:
    run_name: str
    mlflow_run_id: str
    tracking_uri: str
    iterations: int
    reward_mean: list[float]
    wall_seconds: float
    stage_seconds: dict[str, list[float]]
    metrics: list[dict[str, float]] = field(default_factory=list)
    policy_path: str = ""
    eval: dict[int, dict[str, float]] = field(default_factory=dict)
    """Held-out metrics by policy version (eval.path set)."""
    first_step_here: int = 0
    """The first step this process ran (a resumed run: the steps before came from an earlier one);
    iterations when it ran none. wall_seconds is this process's."""

    def reward_gain(self) -> tuple[float, float, int]:
        """(mean reward of the first iterations, of the last ones, window): window = a quarter of the
        run, at most 10 iterations."""
        w = max(1, min(10, len(self.reward_mean) // 4))
        first, last = self.reward_mean[:w], self.reward_mean[-w:]
        return sum(first) / len(first), sum(last) / len(last), w

    def to_json(self) -> dict:
        first, last, window = self.reward_gain() if self.reward_mean else (float("nan"),) * 2 + (0,)
        return {
            "reward_first_mean": first, "reward_last_mean": last, "reward_window": window,
            "run_name": self.run_name, "mlflow_run_id": self.mlflow_run_id, "tracking_uri": self.tracking_uri,
            "iterations": self.iterations, "reward_mean": self.reward_mean, "wall_seconds": self.wall_seconds,
            "stage_seconds": {s: sum(v) for s, v in self.stage_seconds.items()},
            "stage_seconds_per_iteration": self.stage_seconds, "policy_path": self.policy_path,
            "metrics": self.metrics, "eval": {str(v): m for v, m in sorted(self.eval.items())},
            "first_step_here": self.first_step_here,
        }


def run_folder(cfg: GRPOConfig) -> RunFolder:
    """The run's folder (storage/run_folder.py): every path the run writes."""
    return RunFolder.at(cfg.runs_dir, cfg.run_name)


def tracking_uri(cfg: GRPOConfig) -> str:
    """mlflow.tracking_uri, or sqlite in the run folder."""
    return cfg.mlflow.tracking_uri or run_folder(cfg).tracking_uri


def _init_ranks(client, cfg: GRPOConfig, pools: Pools, policy: PolicyRef) -> None:
    # One training rank per train worker: pp x dp x tp global ranks, each deriving its mesh
    # coordinate from its rank (stages/train/layout.py). The rendezvous listens on rank 0's host,
    # on a port free there. Every worker imports the engine first, so the rendezvous's
    # train.timeout_s bounds the rendezvous only, not a cold torch import on a loaded host.
    addresses = list(pools.train_addresses)
    client.run(tasks.worker_ready, workers=addresses)
    port = client.submit(free_port, pools.train_host, workers=addresses[:1],
                         pure=False).result(timeout=cfg.cluster.worker_wait_s)
    init_method = f"tcp://{pools.train_host}:{port}"
    reference = run_folder(cfg).policy_store().ref(0)  # the run's reference, whatever version resumes
    futures = [client.submit(tasks.init_train_rank, cfg, r, init_method, policy, reference, workers=[w],
                             resources={"train": 1}, pure=False, key=f"init-train-{r}-{cfg.run_name}-{port}")
               for r, w in enumerate(addresses)]
    # Loading the shard takes a moment, the rendezvous at most train.timeout_s; a rank pinned to
    # a worker that died meanwhile would wait forever.
    limit_s = cfg.cluster.worker_wait_s + cfg.train.timeout_s
    try:
        wait(futures, timeout=limit_s)
    except TimeoutError as exc:
        late = [f"rank {r} on {pools.train[r]}" for r, f in enumerate(futures) if f.status == "pending"]
        for f in futures:
            f.cancel()
        raise ClusterError(f"training ranks did not start within cluster.worker_wait_s + train.timeout_s = "
                           f"{limit_s:.0f} s: {', '.join(late)}") from exc
    client.gather(futures)
    weight_sync.open_channel(client, cfg, pools, policy)  # cluster.weight_sync = memory only


def _resume_point(cfg: GRPOConfig, folder: RunFolder) -> tuple[int, int | None]:
    """(first step to run, policy version to start from) of an existing run folder."""
    store, policies = folder.rollout_store(), folder.policy_store()
    step = 0
    # A step counts once its metrics are stored and logged (the "lineage" mark, written last, with
    # them): summary.json is built from the stored metrics of every step this process does not run.
    while step < cfg.iterations and _logged(store, step) and policies.is_complete(step + 1):
        step += 1
    return step, (step if policies.is_complete(step) else None)


def _logged(store, step: int) -> bool:
    """Whether step ``step`` is published and logged, its metrics stored with its "lineage" mark."""
    attrs = store.attrs(step) if store.has_step(step) else {}
    return {"publish", "lineage"} <= set(attrs.get("complete", ())) and "metrics" in attrs


def remaining_steps(cfg: GRPOConfig) -> range:
    """The steps a run of ``cfg`` would still run in its run folder (empty: nothing to do)."""
    return range(_resume_point(cfg, run_folder(cfg))[0], cfg.iterations)


def _finished_summary(cfg: GRPOConfig, folder: RunFolder, tracking_uri: str) -> RunSummary:
    """The summary of a run with every step published, read back from its summary.json."""
    data = folder.load_summary()
    nan = float("nan")
    return RunSummary(
        run_name=data["run_name"], mlflow_run_id=data["mlflow_run_id"], tracking_uri=tracking_uri,
        iterations=data["iterations"], reward_mean=[nan if r is None else r for r in data["reward_mean"]],
        wall_seconds=data["wall_seconds"], stage_seconds=data["stage_seconds_per_iteration"],
        metrics=[{k: nan if v is None else v for k, v in m.items()} for m in data["metrics"]],
        policy_path=data["policy_path"], eval={int(v): m for v, m in data.get("eval", {}).items()},
        first_step_here=data.get("first_step_here", 0))


def fresh_run(cfg: GRPOConfig) -> GRPOConfig:
    """``cfg`` with run_name + "-<k>", the smallest k >= 2 naming no existing run folder."""
    k = 2
    while Path(RunFolder.at(cfg.runs_dir, f"{cfg.run_name}-{k}").root).exists():
        k += 1
    return dataclasses.replace(cfg, run_name=f"{cfg.run_name}-{k}")


def _lineage(cfg: GRPOConfig, folder: RunFolder, uri: str, state: dict | None, first_step: int) -> Lineage:
    """The run's MLflow parent run: the stored one of a resumed run, else a new one; run.json records it."""
    tags = {"grpoflow.config_hash": config_hash(cfg), "grpoflow.resumed_from": str(first_step)}
    lineage = None
    run_id = (state or {}).get("mlflow_run_id")
    if run_id:
        try:
            lineage = Lineage(uri, cfg.mlflow.experiment, cfg.run_name, config_to_dict(cfg), tags=tags,
                              artifact_location=folder.artifacts, run_id=run_id)
        except Exception as exc:  # e.g. mlflow.tracking_uri changed: that store lacks the run
            log.warning("MLflow run %s not found at %s (%s); starting a new parent run", run_id, uri, exc)
    if lineage is None:
        lineage = Lineage(uri, cfg.mlflow.experiment, cfg.run_name, config_to_dict(cfg), tags=tags,
                          artifact_location=folder.artifacts)
    folder.save_run_state({"config": config_to_dict(cfg), "config_hash": config_hash(cfg),
                           "mlflow_run_id": lineage.run_id})
    return lineage


def _stop_with_driver(client, cluster) -> None:
    """Embedded workers exit when this process dies, so a killed run leaves no writer behind."""
    if cluster is not None:
        client.run(tasks.exit_with_parent)


def run(cfg: GRPOConfig, progress: bool = True) -> RunSummary:
    """Run ``cfg.iterations`` GRPO iterations; writes the run folder's summary.json. Bad inputs are
    refused before anything is written (flows/preflight.py); so is a second driver of the same run
    folder, which the first holds locked for its life (a RunFolderError naming its pid)."""
    with run_folder(cfg).lock():
        return _run(cfg, progress)


def _run(cfg: GRPOConfig, progress: bool) -> RunSummary:
    start = time.perf_counter()
    folder = run_folder(cfg)
    state = preflight(cfg, folder)
    folder.create()
    uri = tracking_uri(cfg)
    if not cfg.mlflow.tracking_uri:  # the folder's own store: a copied or moved folder logs into itself
        moved = relocate_artifacts(folder.mlflow_db, folder.artifacts)
        if moved:
            log.info("run folder moved or copied from %s: its MLflow artifacts now resolve in %s", moved,
                     folder.artifacts)
    first_step, version = _resume_point(cfg, folder)
    if first_step >= cfg.iterations and Path(folder.summary).is_file():
        log.info("run %s: all %d iterations are published in %s; nothing to do", cfg.run_name, cfg.iterations,
                 folder.root)
        return _finished_summary(cfg, folder, uri)
    machine_rate = _machine_rate(cfg, folder) if cfg.train.device == "cpu" else None
    _warn_slow_bfloat16(cfg, folder)
    client, cluster = start_cluster(cfg)
    lineage = None
    try:
        _stop_with_driver(client, cluster)
        pools = check_pools(client, cfg)
        lineage = _lineage(cfg, folder, uri, state, first_step)
        lineage.set_tags({"dask.dashboard_link": dashboard_link(client) or "none"})
        if version is None:
            log.info("policy v0: %s", cfg.model.path or
                     f"the task's tiny model, warmed up for {cfg.warmup.steps} steps (cached in {folder.cache_root})")
            policy = client.submit(tasks.make_base_policy, cfg, folder, workers=[pools.train_addresses[0]],
                                   pure=False).result()
        else:
            policy = folder.policy_store().ref(version)
        log.info("starting %d training ranks from policy v%d; %d iterations from step %d",
                 len(pools.train), policy.version, cfg.iterations - first_step, first_step)
        _init_ranks(client, cfg, pools, policy)
        evals = EvalScheduler(client, cfg, folder, pools)
        evals.catch_up(policy.version)
        results = _loop(client, cfg, pools, folder, policy, first_step, lineage, progress,
                        host_cpu=_HostCPU() if cluster is not None else None, on_published=evals.published,
                        machine_rate=machine_rate)
        evals.gather(cfg.cluster.iteration_timeout_s)
        # Every stored evaluation of this eval config, an earlier process's too, once on the parent.
        evaluated = load_eval_results(cfg, folder)
        lineage.log_evals(evaluated)
        eval_plot = save_eval_plot(evaluated, folder.plots)
        if eval_plot is not None:
            lineage.log_plots([eval_plot])
        summary = _summarise(cfg, lineage, uri, folder, results, time.perf_counter() - start, evaluated)
        summary_path = folder.save_summary(summary.to_json())
        lineage.log_summary({"wall_seconds": summary.wall_seconds, **_idle_fractions(results)}, [summary_path])
        lineage.finish()
        return summary
    except BaseException:
        if lineage is not None:
            lineage.finish("FAILED")
        raise
    finally:
        try:  # bounded: a frozen worker never answers
            run_on_workers(client, tasks.shutdown_train_rank, cfg.run_name, timeout_s=cfg.cluster.worker_wait_s)
            # a vLLM engine's server process goes with it
            run_on_workers(client, tasks.close_engines, timeout_s=cfg.cluster.worker_wait_s)
        except Exception as exc:
            log.warning("clean-up of the workers failed: %s: %s", type(exc).__name__, exc)
        client.close()
        if cluster is not None:
            cluster.close()


class _HostCPU:
    """CPU seconds (user + system) of this process and every process it started (an embedded
    cluster's nannies, workers and their reward processes) since the last :meth:`take`: the host
    CPU a step costs when taken once per finished step. A process that exits between two takes
    loses its last interval; one that starts counts whole."""

    def __init__(self):
        self._seen: dict[int, float] = {}
        self.take()

    def take(self) -> float:
        me = psutil.Process()
        now: dict[int, float] = {}
        for proc in (me, *me.children(recursive=True)):
            try:
                t = proc.cpu_times()
                now[proc.pid] = t.user + t.system
            except psutil.Error:  # gone meanwhile
                continue
        spent = sum(max(0.0, c - self._seen.get(pid, 0.0)) for pid, c in now.items())
        self._seen = now
        return spent


def _machine_rate(cfg: GRPOConfig, folder: RunFolder) -> float:
    """FLOP/s of this host's matmul in the training dtype with every core (measured once per host,
    dtype and torch version, cached in runs_dir/_cache, which keeps the highest rate seen: every
    start measures again for a fraction of a second): what a step's MFU is taken against. Taken
    before the workers start."""
    return matmul_rate(Path(folder.cache_root) / HOST_RATES_FILE, cfg.train.dtype, "cpu", host_cores(),
                       refresh_seconds=0.3)


def bfloat16_on_cpu(cfg: GRPOConfig) -> list[str]:
    """The keys that put bfloat16 matmuls on this host's CPU: train.dtype (ranks on the CPU) and
    rollout.dtype (engines on the CPU: device cpu, or auto where torch sees no GPU)."""
    keys = []
    if cfg.train.dtype == "bfloat16" and cfg.train.device == "cpu":
        keys.append("train.dtype")
    engines_on_cpu = cfg.rollout.device == "cpu" or (cfg.rollout.device == "auto" and not torch.cuda.is_available())
    if cfg.rollout.dtype == "bfloat16" and engines_on_cpu:
        keys.append("rollout.dtype")
    return keys


def slow_bfloat16_message(keys: list[str], bf16_rate: float, fp32_rate: float) -> str | None:
    """The one-line warning for bfloat16 keys on a CPU whose bfloat16 matmul is slower than its
    float32 one (no AVX-512 BF16 or AMX: the kernels convert), or None."""
    if not keys or bf16_rate >= fp32_rate:
        return None
    return (f"{' and '.join(f'{k}=bfloat16' for k in keys)} on this CPU: its bfloat16 matmul measured "
            f"{bf16_rate / 1e9:.3g} GFLOP/s against float32's {fp32_rate / 1e9:.3g} ({fp32_rate / bf16_rate:.3g}x "
            f"slower; the CPU lacks native bfloat16), so float32 is faster here")


def _warn_slow_bfloat16(cfg: GRPOConfig, folder: RunFolder) -> None:
    keys = bfloat16_on_cpu(cfg)
    if keys:
        rates = [matmul_rate(Path(folder.cache_root) / HOST_RATES_FILE, dtype, "cpu", host_cores())
                 for dtype in ("bfloat16", "float32")]  # cached per host: measured once, about a second each
        message = slow_bfloat16_message(keys, *rates)
        if message:
            log.warning(message)


def _model_flops_metrics(cfg: GRPOConfig, shape, store, result: IterationResult, rate: float) -> dict[str, float]:
    """The step's model FLOPs per phase (from its stored prompt and completion lengths) and its MFU
    against ``rate`` (stages/perf)."""
    a = store.read(result.step, "prompt_len", "length", "reward_failed")
    G = cfg.rollout.group_size
    flops = step_model_flops(shape, a["prompt_len"], a["length"], group_size=G,
                             reference="reference" in result.stage_seconds,
                             trained=trained_samples(~a["reward_failed"], G))
    return step_mfu_metrics(flops, result.stage_seconds, result.metrics.get("iteration_seconds", 0.0), rate)


def _loop(client, cfg: GRPOConfig, pools: Pools, folder: RunFolder, policy: PolicyRef, first_step: int,
          lineage: Lineage, progress: bool, host_cpu: _HostCPU | None = None,
          on_published: Callable[[PolicyRef], None] = lambda policy: None,
          machine_rate: float | None = None) -> list[IterationResult]:
    results: list[IterationResult] = []
    store = folder.rollout_store()
    shape = cfg.model_shape if machine_rate else None  # for the model FLOPs of each step
    s = cfg.rollout.max_staleness
    published = {policy.version: policy}  # versions the rule may still ask for
    in_flight: deque[PendingIteration] = deque()
    submitted: dict[int, tuple[int, int]] = {}  # step -> (behaviour version, submission time in epoch ms)
    queue = BackgroundQueue()  # lineage and the next step's Zarr group, while steps run
    outer = tqdm(range(first_step, cfg.iterations), desc="iterations", disable=not progress, unit="it")

    def _finish_step(pending: PendingIteration, advance) -> IterationResult:
        """Wait for the oldest step; on a lost training worker rebuild every rank from the trainer's
        version (weights and optimiser state) and resubmit it and every later step in flight, at
        most cluster.max_restarts times."""
        nonlocal pools
        limit = cfg.cluster.max_restarts
        for attempt in range(limit + 1):
            try:
                return finish_iteration(pending, on_stage=advance, timeout_s=cfg.cluster.iteration_timeout_s)
            except (WorkerLostError, ClusterError) as exc:
                # A rebuild that fails because a worker died during it is one more lost worker;
                # any other cluster failure ends the run.
                if isinstance(exc, ClusterError) and not lost_workers(client, pools):
                    raise
                if attempt == limit:
                    raise IterationError(f"{exc} (gave up after cluster.max_restarts={limit} restarts)") from exc
                trainer = published.get(pending.step) or folder.policy_store().ref(pending.step)
                log.warning("%s; rebuilding every training rank from policy v%d and rerunning step %d "
                            "(restart %d of %d)", exc, trainer.version, pending.step, attempt + 1, limit)
                later = list(in_flight)
                for q in (pending, *later):
                    q.cancel()
                pools = restart_train_workers(client, cfg, pools)
                _init_ranks(client, cfg, pools, trainer)
                in_flight.clear()
                pending = submit_iteration(client, cfg, pools, folder, pending.step, policy_for(pending.policy.version),
                                           attempt=attempt + 1)
                prev, resubmitted = pending.train_gate, [pending]
                for q in later:  # a version a resubmitted step publishes: its new publish task
                    in_flight.append(submit_iteration(client, cfg, pools, folder, q.step,
                                                      policy_for(q.policy.version, resubmitted), prev,
                                                      attempt=attempt + 1))
                    prev = in_flight[-1].train_gate
                    resubmitted.append(in_flight[-1])
        raise AssertionError("unreachable")

    def policy_for(version: int, flight=None) -> Policy:
        """Version ``version``: published, or a :class:`PendingPolicy` when a step in ``flight``
        (default: the steps in flight) publishes it."""
        maker = next((q for q in (in_flight if flight is None else flight) if q.step + 1 == version), None)
        if maker is not None:
            return PendingPolicy(version, str(folder.policy_store().version_path(version)),
                                 maker.stages["publish"].gate, maker.done_at)
        return published.get(version) or folder.policy_store().ref(version)

    def open_child(step: int, start_ms: int) -> StepRun:
        """The step's child run, opened once the step has run (its start: ``start_ms``); an
        interrupted process may have left one for the steps it had in flight (s + 2)."""
        version, _ = submitted.pop(step)
        return lineage.start_step(step, version, start_time_ms=start_ms, reopen=step <= first_step + s + 1)

    def log_step(result: IterationResult, plot_rows: list[dict] | None, done_ms: int) -> None:
        """The step's lineage (on the background queue's thread), then its "lineage" mark: written
        last, with the step's metrics for summary.json, it says the step needs no rerun. The child
        run spans the step's own work: from its first task's start (its submission, when every
        task was found done) to the moment it finished, not the logging after."""
        nonlocal dropped_below
        t0 = time.perf_counter()
        step = result.step
        trace_path = folder.save_trace(step, result.trace_events)
        # Not before its submission: a resumed step's stored results carry an earlier process's times.
        submitted_s = submitted[step][1] / 1000
        started = max(min((start for _, start, _ in result.busy), default=submitted_s), submitted_s)
        child = open_child(step, int(started * 1000))
        child.end_time_ms = done_ms
        with child:  # decoded samples, timeline, dataset with schema, metrics and policy; ends the child run
            policy_codec = codec(result.policy.path)
            table = load_sample_table(folder.rollouts, step, policy_codec.decode, max(cfg.mlflow.sample_groups, 1),
                                      policy_codec.decode_prompt)
            tags = child.log_samples(table, set_tag=False) if cfg.mlflow.sample_groups else {}
            child.log_artifact(trace_path, "timelines")
            child.log_rollouts(store.ref(step).path, store.digest(step), store.array_specs(step))
            if result.reward_first_error:
                tags["reward.first_error"] = result.reward_first_error
            for label, why in result.reward_function_errors.items():  # each failing function's first reason
                tags[f"reward.{label}.first_error"] = why
            # policy.path relative to the run folder: the tag stays true when the folder moves.
            policy_path = os.path.relpath(result.policy.path, folder.root)
            child.log_metrics(result.metrics, tags={**tags, **child.policy_tags(
                result.policy.version, policy_path, result.policy.sha256)})
        if plot_rows is not None:  # refresh the plots
            lineage.log_plots(save_run_plots(plot_rows, folder.plots, STAGES))
        if step % cfg.mlflow.plot_every_steps == 0 and table["id"]:  # one decoded example now and then
            tqdm.write(f"{table['id'][0]} (policy v{table['policy_version'][0]}): {table['prompt'][0]!r} -> "
                       f"{table['completion'][0]!r}, reward {table['reward'][0]:.2f}, "
                       f"advantage {table['advantage'][0]:+.2f}")
        metrics = {k: float(v) for k, v in result.metrics.items()}
        metrics["lineage_seconds"] = time.perf_counter() - t0
        store.mark_complete(step, "lineage", metrics=metrics, mlflow_run_id=child.run_id)
        if cfg.train.keep_optimizer_state == "latest":
            # Steps are logged in order, so a resume now starts at step + 1, from the version this
            # step published, or later. The version it started from keeps its state too, so that a
            # rerun of this step (its group deleted) can still start from it; the ones before are
            # never loaded again (from v0 on the first call: a process killed between a mark and
            # its drop left one behind).
            for version in range(dropped_below, step):
                folder.policy_store().drop_optimizer_state(version)
            dropped_below = max(dropped_below, step)
        drop_old_versions(step + 1)

    dropped_below = 0  # versions below this hold no optimiser state (train.keep_optimizer_state=latest)
    weights_below = 1  # versions below this were looked at by drop_old_versions (v0 is always kept)

    def drop_old_versions(latest: int) -> None:
        """train.keep_versions: delete the weights of the versions older than the newest N that no
        rule keeps (:func:`keeps_version`), once ``latest`` is published and its step logged."""
        nonlocal weights_below
        if cfg.train.keep_versions is None:
            return
        n = max(cfg.train.keep_versions, s + 2)  # the versions a resumed or in-flight step may start from
        store_ = folder.policy_store()
        for version in range(weights_below, latest - n + 1):
            if not keeps_version(cfg, version) and store_.is_complete(version):
                freed = store_.drop_version(version)
                log.debug("policy v%d: weights deleted (train.keep_versions=%d), %d bytes freed", version, n, freed)
        weights_below = max(weights_below, latest - n + 1)
    failed_steps: list[int] = []  # the latest run of consecutive steps whose every reward failed

    codecs: list[TextCodec] = []

    def codec(policy_path: str) -> TextCodec:
        """The run's tokenizer, read once: every version is published with the base policy's."""
        if not codecs:
            codecs.append(TextCodec.from_policy_folder(policy_path, cfg.dataset.chat_template,
                                                       cfg.dataset.system_prompt))
        return codecs[0]

    prepared: dict[int, Future] = {}  # step -> whether prepare_step created its group

    def take_prepared(step: int) -> bool:
        """Whether step ``step``'s group was created ahead (then it is not created again); a
        preparation that has not started is cancelled, so it never runs beside the submission."""
        future = prepared.pop(step, None)
        return future is not None and not future.cancel() and future.result()

    plotted_at = -float("inf")  # time.monotonic() of the last redraw of the plots
    # A resumed run's plots start with the steps an earlier process logged (their stored metrics).
    earlier_rows = [{"step": step, **store.attrs(step)["metrics"]} for step in range(first_step)
                    if store.has_step(step) and "metrics" in store.attrs(step)]

    def finish_oldest() -> None:
        nonlocal plotted_at
        pending = in_flight.popleft()
        step = pending.step
        bar = tqdm(total=len(pending.names), desc=f"step {step}", leave=False, disable=not progress, unit="stage")

        def advance(stage: str) -> None:
            bar.set_postfix_str(stage)
            bar.update(1)

        try:
            result = _finish_step(pending, advance)
        except BaseException:
            try:  # the step's own error is the one to report, not a failed bookkeeping call's
                queue.submit(lambda: open_child(step, submitted[step][1]).end("FAILED"))
            except Exception as exc:
                log.warning("step %d: its child run is not marked FAILED: %s", step, exc)
            raise
        done_ms = int(time.time() * 1000)
        bar.close()
        if "train" in result.skipped:
            # The shards came from an earlier process; the ranks still hold the step's input
            # policy, so they restart from the version just published.
            _init_ranks(client, cfg, pools, result.policy)
        result.metrics["publish_seconds_total"] = result.stage_seconds["publish"]
        if host_cpu is not None:  # embedded cluster: every process of the run is on this host
            result.metrics["host_cpu_seconds"] = host_cpu.take()
        # Staleness of the consumed rows: trainer version minus each row's behaviour version.
        lag = trainer_version(step) - store.read(step, "policy_version")["policy_version"].astype(np.int64)
        result.metrics["staleness_mean"], result.metrics["staleness_max"] = float(lag.mean()), float(lag.max())
        if machine_rate:
            result.metrics.update(_model_flops_metrics(cfg, shape, store, result, machine_rate))
        published[result.policy.version] = result.policy
        on_published(result.policy)
        results.append(result)
        due = len(results) % cfg.mlflow.plot_every_steps == 0
        plot = (due and time.monotonic() >= plotted_at + cfg.mlflow.plot_min_interval_s) or step == cfg.iterations - 1
        if plot:
            plotted_at = time.monotonic()
        rows = earlier_rows + [{"step": r.step, **r.metrics} for r in results] if plot else None
        queue.submit(log_step, result, rows, done_ms)
        _check_rewards(cfg, result, failed_steps)  # after the step's lineage is queued: a stop still logs it
        outer.update(1)
        outer.set_postfix(reward=f"{result.metrics.get('reward_mean', float('nan')):.3f}")

    try:
        for step in range(first_step, cfg.iterations):
            # Step k asks for the version step k - s - 1 publishes. It is submitted while that step
            # is still in flight, its tasks waiting on that step's publish task: the scheduler starts
            # its rollout the moment the version is out, with no round trip through this loop.
            release = released_by(step, s)
            while in_flight and release is not None and in_flight[0].step < release:
                finish_oldest()
            if weight_sync.engines_moved(client, cfg, pools):  # a replaced engine rejoins the channel
                while in_flight:  # once the training workers are idle
                    finish_oldest()
                weight_sync.reopen_if_engines_moved(client, cfg, pools, policy_for(behaviour_version(step, s)))
            version = behaviour_version(step, s)
            # A resumed run's first steps may ask for versions published by the earlier process.
            behaviour = policy_for(version)
            prev_train = in_flight[-1].train_gate if in_flight else ()
            submitted[step] = (version, int(time.time() * 1000))  # its child run opens once it has run
            in_flight.append(submit_iteration(client, cfg, pools, folder, step, behaviour, prev_train,
                                              prepared=take_prepared(step)))
            if step + 1 < cfg.iterations:  # its Zarr group, while this step runs
                prepared[step + 1] = queue.submit(prepare_step, cfg, folder, step + 1, behaviour_version(step + 1, s))
            if in_flight[-1].stages["train"].gate is None:
                # Train found complete (a resumed run): the ranks restart from its version when the step
                # finishes, so no later step's training-rank task may be queued before that.
                while in_flight:
                    finish_oldest()
        while in_flight:
            finish_oldest()
        queue.drain()
    finally:
        queue.close()  # a failing run: what is queued still runs (the failed step's child run ends)
    outer.close()
    _add_idle(results)
    return results


def keeps_version(cfg: GRPOConfig, version: int) -> bool:
    """Whether policy ``version`` stays whole whatever its age (train.keep_versions): v0 (the
    reference), every train.keep_every-th, every one the held-out evaluation scores, the run's last."""
    every = cfg.train.keep_every
    evaluated = cfg.eval.enabled and bool(cfg.eval.every_steps) and version % cfg.eval.every_steps == 0
    return version in (0, cfg.iterations) or bool(every and version % every == 0) or evaluated


def _check_rewards(cfg: GRPOConfig, result: IterationResult, failed_steps: list[int]) -> None:
    """Say when a step's rewards failed, with the first reason; stop the run once
    reward.max_failed_steps consecutive steps had every sample's reward fail (they train nothing)."""
    failed = int(result.metrics.get("reward_failed", 0))
    if not failed:
        failed_steps.clear()
        return
    samples = cfg.task.prompts_per_step * cfg.rollout.group_size
    why = result.reward_first_error or "the reason was not recorded"
    by_function = "; ".join(f"{label} failed {int(result.metrics.get(f'reward_failed/{label}', 0))}: {first}"
                            for label, first in result.reward_function_errors.items())
    log.warning("step %d: %d of %d rewards failed; %s", result.step, failed, samples,
                by_function or f"the first: {why}")
    if failed < samples:
        failed_steps.clear()
        return
    failed_steps.append(result.step)
    limit = cfg.reward.max_failed_steps
    if limit and len(failed_steps) >= limit:
        raise IterationError(f"every sample's reward failed in steps {failed_steps[0]}-{failed_steps[-1]} "
                             f"(reward.max_failed_steps={limit}); the first failure: {why}. Fix reward.functions")


def _idle_seconds(busy: list[tuple[float, float]], lo: float, hi: float) -> float:
    """Seconds of [lo, hi] covered by none of the ``busy`` (start, end) intervals."""
    covered, cursor = 0.0, lo
    for a, b in sorted((max(a, lo), min(b, hi)) for a, b in busy if b > lo and a < hi):
        if b > cursor:
            covered += b - max(a, cursor)
            cursor = b
    return max(0.0, (hi - lo) - covered)


def _idle_fractions(results: list[IterationResult]) -> dict[str, float]:
    """Idle seconds of each pool over the run's step windows, as fractions (the per-step idle
    seconds reach the step metrics and summary.json only: they are known once every step has run)."""
    window = sum(r.metrics.get("step_window_seconds", 0.0) for r in results)
    if window <= 0:
        return {}
    return {f"{pool}_idle_fraction": sum(r.metrics.get(f"{pool}_idle_seconds", 0.0) for r in results) / window
            for pool in ("rollout", "train")}


def _add_idle(results: list[IterationResult]) -> None:
    """Idle seconds of the rollout pool and of the training ranks per step: each step's window
    runs from the previous step's last training-rank task end to its own (the run's first window
    from its first task), measured from every step's task timestamps once all have run."""
    busy = {pool: [(a, b) for r in results for p, a, b in r.busy if p == pool] for pool in ("rollout", "train")}
    ends = [max((b for p, _, b in r.busy if p == "train"), default=float("nan")) for r in results]
    starts = [a for pool in busy.values() for a, _ in pool]
    lo = min(starts) if starts else 0.0
    for r, hi in zip(results, ends):
        if hi != hi:  # no training task ran (stages found complete)
            continue
        for pool in ("rollout", "train"):
            r.metrics[f"{pool}_idle_seconds"] = _idle_seconds(busy[pool], lo, hi)
        r.metrics["step_window_seconds"] = hi - lo
        lo = hi


def _summarise(cfg: GRPOConfig, lineage: Lineage, tracking_uri: str, folder: RunFolder,
                results: list[IterationResult], wall_s: float,
                evaluated: dict[int, dict[str, float]] | None = None) -> RunSummary:
    """The summary of every step of the run, resumed ones included, from the metrics stored with
    each step's "lineage" mark, with what this process measured once every step had run (idle
    seconds of the pools); wall_seconds is this process's."""
    store = folder.rollout_store()
    ran = {r.step: r.metrics for r in results}
    metrics = []
    for step in range(cfg.iterations):
        attrs = store.attrs(step)
        if "metrics" not in attrs:  # its "lineage" mark is gone since it was written
            marks = ", ".join(attrs.get("complete", [])) or "none"
            if step not in ran:
                raise IterationError(f"step {step} of {folder.rollouts} has no stored metrics (marks: {marks}); "
                                     "rerun the run to log it again")
            log.warning("step %d of %s lost its stored metrics after this process logged it (marks: %s)",
                        step, folder.rollouts, marks)
        metrics.append({**attrs.get("metrics", {}), **ran.get(step, {})})
    names = STAGES + tuple(s for s in _EXTRA_STAGES if any(f"{s}_seconds" in m for m in metrics))
    last = folder.policy_store().ref(cfg.iterations)
    return RunSummary(
        run_name=cfg.run_name, mlflow_run_id=lineage.run_id, tracking_uri=tracking_uri,
        iterations=len(metrics), reward_mean=[m.get("reward_mean", float("nan")) for m in metrics],
        wall_seconds=wall_s, stage_seconds={s: [m.get(f"{s}_seconds", 0.0) for m in metrics] for s in names},
        metrics=[{"step": step, **m} for step, m in enumerate(metrics)], policy_path=last.path,
        eval=load_eval_results(cfg, folder) if evaluated is None else evaluated,
        first_step_here=min(ran, default=cfg.iterations))


def format_summary(summary: RunSummary) -> str:
    """A plain-text table of the run: reward per iteration and seconds per stage."""
    lines = [f"run {summary.run_name}: {summary.iterations} iterations in {summary.wall_seconds:.1f} s "
             f"(mlflow run {summary.mlflow_run_id})"]
    if summary.first_step_here > 0:  # resumed: the wall time is this process's steps only
        here = summary.iterations - summary.first_step_here
        steps_s = sum(m.get("iteration_seconds", 0.0) for m in summary.metrics)
        lines[0] = (f"run {summary.run_name}: {summary.iterations} iterations, {here} of them (from step "
                    f"{summary.first_step_here}) in this process's {summary.wall_seconds:.1f} s; "
                    f"{steps_s:.1f} s of steps over all {summary.iterations} (mlflow run {summary.mlflow_run_id})")
    header = f"{'step':>4} {'reward':>7} {'loss':>8} {'kl':>7} {'clip':>6} {'bubble':>6} {'mfu':>5} " + \
        " ".join(f"{s:>9}" for s in STAGES)  # full names: "reference" and "advantage" are the widest
    lines.append(header)
    for m in summary.metrics:
        kl = f"{m['kl']:.4f}" if "kl" in m else "-"  # no reference pass: no kl
        lines.append(f"{m['step']:>4} {m.get('reward_mean', float('nan')):>7.3f} {m.get('loss', 0):>8.4f} {kl:>7} "
                     f"{m.get('clip_fraction', 0):>6.3f} {m.get('bubble_fraction', 0):>6.3f} "
                     f"{m.get('mfu', float('nan')):>5.2f} "
                     + " ".join(f"{m[f'{s}_seconds']:>9.2f}" if f"{s}_seconds" in m else f"{'-':>9}"
                                for s in STAGES))
    totals = " ".join(f"{sum(summary.stage_seconds.get(s, [0.0])):>9.2f}" for s in STAGES)
    lines.append(f"{'all':>4} {'':>7} {'':>8} {'':>7} {'':>6} {'':>6} {'':>5} {totals}")
    measured = [m for m in summary.metrics if "mfu" in m]
    if measured:
        flops = sum(m[f"model_flops_{p}"] for m in measured for p in STEP_PHASES)
        seconds = sum(m["iteration_seconds"] for m in measured)
        rate = measured[-1]["matmul_flops_per_s"]
        lines.append(f"model FLOPs: {flops / 1e9:.1f} GFLOP in {seconds:.1f} s of steps, "
                     f"{flops / seconds / 1e9:.1f} GFLOP/s = {flops / seconds / rate:.0%} of this host's "
                     f"measured matmul rate ({rate / 1e9:.1f} GFLOP/s on every core)")
    if summary.reward_mean:
        first, last, w = summary.reward_gain()
        lines.append(f"reward: mean of the first {w} iterations {first:.3f}, of the last {w} {last:.3f} "
                     f"({last - first:+.3f})")
    if summary.eval:
        lines.append(format_eval(summary.eval))
    return "\n".join(lines)
