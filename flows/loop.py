"""The synchronous GRPO loop: set up the cluster and the training ranks, run the iterations,
record lineage, write the run summary.

Resuming: a run folder that already holds published steps continues after the last one, from the
policy version it published; a step left half-done is picked up after its last complete stage.

Losing a training worker: the step ends with a WorkerLostError (flows/iteration.py); every rank
then gets a fresh worker process, is rebuilt from the step's input policy (the last published
version) and the step is rerun, at most cluster.max_restarts times. The step's stages that were
marked complete are kept, the others rewrite their rows whole. Optimiser state is not stored with
policy versions, so a rebuilt rank starts with fresh AdamW moments.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

from distributed import wait
from tqdm.auto import tqdm

from flows import tasks
from flows.cluster import ClusterError, Pools, check_pools, lost_workers, restart_train_workers, start_cluster
from flows.iteration import STAGES, IterationError, IterationResult, WorkerLostError, run_iteration
from flows.schema import GRPOConfig, config_hash, config_to_dict
from stages.train.rendezvous import free_port
from storage.lineage import Lineage
from storage.policies import PolicyRef
from storage.run_folder import RunFolder

__all__ = ["RunSummary", "run", "run_folder", "tracking_uri", "format_summary"]

log = logging.getLogger(__name__)


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
            "metrics": self.metrics,
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
    port = client.submit(free_port, workers=addresses[:1], pure=False).result(timeout=cfg.cluster.worker_wait_s)
    init_method = f"tcp://{pools.train_host}:{port}"
    futures = [client.submit(tasks.init_train_rank, cfg, r, init_method, policy, workers=[w],
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


def _resume_point(cfg: GRPOConfig, folder: RunFolder) -> tuple[int, int | None]:
    """(first step to run, policy version to start from) of an existing run folder."""
    store, policies = folder.rollout_store(), folder.policy_store()
    step = 0
    while step < cfg.iterations and "publish" in store.completed(step) and policies.is_complete(step + 1):
        step += 1
    return step, (step if policies.is_complete(step) else None)


def run(cfg: GRPOConfig, progress: bool = True) -> RunSummary:
    """Run ``cfg.iterations`` GRPO iterations; writes the run folder's summary.json."""
    start = time.perf_counter()
    folder = run_folder(cfg).create()
    uri = tracking_uri(cfg)
    first_step, version = _resume_point(cfg, folder)
    client, cluster = start_cluster(cfg)
    lineage = None
    try:
        pools = check_pools(client, cfg)
        lineage = Lineage(uri, cfg.mlflow.experiment, cfg.run_name, config_to_dict(cfg),
                          tags={"grpoflow.config_hash": config_hash(cfg), "grpoflow.resumed_from": str(first_step)},
                          artifact_location=folder.artifacts)
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
        results = _loop(client, cfg, pools, folder, policy, first_step, lineage, progress)
        summary = _summarise(cfg, lineage, uri, results, time.perf_counter() - start)
        summary_path = folder.save_summary(summary.to_json())
        lineage.log_summary({"wall_seconds": summary.wall_seconds}, [summary_path])
        lineage.finish()
        return summary
    except BaseException:
        if lineage is not None:
            lineage.finish("FAILED")
        raise
    finally:
        try:
            client.run(tasks.shutdown_train_rank, cfg.run_name)
        except Exception:
            pass
        client.close()
        if cluster is not None:
            cluster.close()


def _loop(client, cfg: GRPOConfig, pools: Pools, folder: RunFolder, policy: PolicyRef, first_step: int,
          lineage: Lineage, progress: bool) -> list[IterationResult]:
    results = []
    store = folder.rollout_store()
    outer = tqdm(range(first_step, cfg.iterations), desc="iterations", disable=not progress, unit="it")
    for step in outer:
        bar = tqdm(total=len(STAGES), desc=f"step {step}", leave=False, disable=not progress, unit="stage")

        def advance(stage: str) -> None:
            bar.set_postfix_str(stage)
            bar.update(1)

        result, pools = _run_step(client, cfg, pools, folder, step, policy, advance)
        bar.close()
        if "train" in result.skipped:
            # The shards came from an earlier process; the ranks still hold the step's input
            # policy, so they restart from the version just published.
            _init_ranks(client, cfg, pools, result.policy)
        t0 = time.perf_counter()
        result.metrics["publish_seconds_total"] = result.stage_seconds["publish"]
        trace_path = folder.save_trace(step, result.trace_events)
        cid = lineage.log_iteration(step, result.metrics, store.ref(step).path, store.digest(step),
                                    result.policy.path, result.policy.sha256, result.policy.version)
        lineage.log_artifact(cid, trace_path, "timelines")
        result.metrics["lineage_seconds"] = time.perf_counter() - t0
        policy = result.policy
        results.append(result)
        outer.set_postfix(reward=f"{result.metrics.get('reward_mean', float('nan')):.3f}")
    return results


def _run_step(client, cfg: GRPOConfig, pools: Pools, folder: RunFolder, step: int, policy: PolicyRef,
              on_stage) -> tuple[IterationResult, Pools]:
    """Run one step, rebuilding every rank from ``policy`` and rerunning the step when a training
    worker is lost (at most cluster.max_restarts times); returns the result and the pools it ran on."""
    limit = cfg.cluster.max_restarts
    for attempt in range(limit + 1):
        try:
            if attempt:
                pools = restart_train_workers(client, cfg, pools)
                _init_ranks(client, cfg, pools, policy)
            return run_iteration(client, cfg, pools, folder, step, policy, on_stage=on_stage,
                                 timeout_s=cfg.cluster.iteration_timeout_s, attempt=attempt), pools
        except (WorkerLostError, ClusterError) as exc:
            # A rebuild that fails because a worker died during it is one more lost worker; any
            # other cluster failure ends the run.
            if isinstance(exc, ClusterError) and not lost_workers(client, pools):
                raise
            if attempt == limit:
                raise IterationError(f"{exc} (gave up after cluster.max_restarts={limit} restarts)") from exc
            log.warning("%s; rebuilding every training rank from policy v%d and rerunning step %d "
                        "(restart %d of %d)", exc, policy.version, step, attempt + 1, limit)
    raise AssertionError("unreachable")


def _summarise(cfg: GRPOConfig, lineage: Lineage, tracking_uri: str, results: list[IterationResult],
               wall_s: float) -> RunSummary:
    return RunSummary(
        run_name=cfg.run_name, mlflow_run_id=lineage.run_id, tracking_uri=tracking_uri,
        iterations=len(results), reward_mean=[r.metrics.get("reward_mean", float("nan")) for r in results],
        wall_seconds=wall_s, stage_seconds={s: [r.stage_seconds[s] for r in results] for s in STAGES},
        metrics=[{"step": r.step, **r.metrics} for r in results],
        policy_path=results[-1].policy.path if results else "")


def format_summary(summary: RunSummary) -> str:
    """A plain-text table of the run: reward per iteration and seconds per stage."""
    lines = [f"run {summary.run_name}: {summary.iterations} iterations in {summary.wall_seconds:.1f} s "
             f"(mlflow run {summary.mlflow_run_id})"]
    header = f"{'step':>4} {'reward':>7} {'loss':>8} {'kl':>7} {'clip':>6} {'bubble':>6} " + \
        " ".join(f"{s[:7]:>7}" for s in STAGES)
    lines.append(header)
    for m in summary.metrics:
        lines.append(f"{m['step']:>4} {m.get('reward_mean', float('nan')):>7.3f} {m.get('loss', 0):>8.4f} "
                     f"{m.get('kl', 0):>7.4f} {m.get('clip_fraction', 0):>6.3f} {m.get('bubble_fraction', 0):>6.3f} "
                     + " ".join(f"{m[f'{s}_seconds']:>7.2f}" for s in STAGES))
    totals = " ".join(f"{sum(v):>7.2f}" for v in summary.stage_seconds.values())
    lines.append(f"{'all':>4} {'':>7} {'':>8} {'':>7} {'':>6} {'':>6} {totals}")
    if summary.reward_mean:
        first, last, w = summary.reward_gain()
        lines.append(f"reward: mean of the first {w} iterations {first:.3f}, of the last {w} {last:.3f} "
                     f"({last - first:+.3f})")
    return "\n".join(lines)
