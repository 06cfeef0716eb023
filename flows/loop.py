"""The GRPO loop: set up the cluster and the training ranks, run the iterations,
record lineage, write the run summary.

Resuming: a run folder that already holds published steps continues after the last one, from the
policy version it published and the optimiser state saved with it, against the run's reference
(policy v0), in the same MLflow parent run; a step left half-done is picked up after its last
complete stage. A folder started with another config is refused (flows/preflight.py), and
``new=True`` starts over in a fresh folder instead (docs/reliability.md).

The steps themselves run in flows/run_loop.py (:class:`RunLoop`: submit, finish, recover, log),
asynchronous ones (rollout.max_staleness) and the recovery from a lost training worker included.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path

import psutil
import torch

from flows import tasks
from flows.cluster import check_pools, dashboard_link, run_on_workers, start_cluster
from flows.config import GRPOConfig, config_hash, config_to_dict
from flows.evaluate import EvalScheduler, format_eval, load_eval_results
from flows.iteration import STAGES, IterationError, IterationResult
from flows.preflight import preflight
from flows.run_loop import RunLoop, idle_fractions, init_ranks
from stages.perf import STEP_PHASES
from storage.host_rates import HOST_RATES_FILE, host_cores, matmul_rate
from storage.lineage import Lineage, relocate_artifacts
from storage.plots import save_eval_plot
from storage.run_folder import RunFolder

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
        init_ranks(client, cfg, pools, policy)
        evals = EvalScheduler(client, cfg, folder, pools)
        evals.catch_up(policy.version)
        results = RunLoop(client, cfg, pools, folder, policy, first_step, lineage, progress,
                          host_cpu=_HostCPU().take if cluster is not None else None, on_published=evals.published,
                          machine_rate=machine_rate).run()
        evals.gather(cfg.cluster.iteration_timeout_s)
        # Every stored evaluation of this eval config, an earlier process's too, once on the parent.
        evaluated = load_eval_results(cfg, folder)
        lineage.log_evals(evaluated)
        eval_plot = save_eval_plot(evaluated, folder.plots)
        if eval_plot is not None:
            lineage.log_plots([eval_plot])
        summary = _summarise(cfg, lineage, uri, folder, results, time.perf_counter() - start, evaluated)
        summary_path = folder.save_summary(summary.to_json())
        lineage.log_summary({"wall_seconds": summary.wall_seconds, **idle_fractions(results)}, [summary_path])
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
