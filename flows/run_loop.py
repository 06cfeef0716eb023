"""The run's steps as a loop whose methods are its phases (flows/loop.py sets up the cluster and the
ranks around it, and writes the summary after it).

    for each step k:  submit(k)        first finishing the steps k may not overtake (released_by)
                        └ finish_oldest()   wait ─► record ─► log (lineage, on the background queue)
                                             └ a lost training worker ─► recover ─► wait again

rollout.max_staleness s: step k generates from version max(0, k - s), which step k - s - 1
publishes (flows/async_schedule.py). Step k is submitted once step k - s - 2 has finished, so up to
s + 2 steps are in flight: while step k - s - 1 runs, step k's tasks wait on its publish task, and
the scheduler starts step k's rollout as soon as the version is out, without a round trip through
the loop (its lineage, the next submission). Steps finish, and are logged, in order. s = 0 is the
synchronous loop: step k generates from the version step k - 1 has just published.

Losing a training worker: the step ends with a WorkerLostError (flows/iteration.py); every rank
then gets a fresh worker process, is rebuilt from the trainer's version (weights and optimiser
state) and the steps in flight are resubmitted (:meth:`RunLoop.recover`), at most
cluster.max_restarts times per step. The stages already marked complete are kept; the others
rewrite their rows whole.

The loop's state is in the fields of :class:`RunLoop`: the steps in flight (oldest first), the
versions published, each step's submission, the next steps' Zarr groups made ahead, what has been
deleted from the policy store, and the background queue that logs while steps run.
"""

from __future__ import annotations

import logging
import os
import time
from collections import deque
from concurrent.futures import Future
from typing import Callable

import numpy as np
from distributed import wait
from tqdm.auto import tqdm

from flows import tasks, weight_sync
from flows.async_schedule import behaviour_version, released_by, trainer_version
from flows.background import BackgroundQueue
from flows.cluster import ClusterError, Pools, lost_workers, restart_train_workers
from flows.iteration import (STAGES, IterationError, IterationResult, PendingIteration, PendingPolicy, Policy,
                             WorkerLostError, finish_iteration, prepare_step, submit_iteration)
from flows.config import GRPOConfig
from stages.advantage import trained_samples
from stages.perf import step_mfu_metrics, step_model_flops
from stages.policy.tokenizer import TextCodec
from stages.tcp_store import free_port
from storage.lineage import Lineage, StepRun
from storage.plots import save_run_plots
from storage.policies import PolicyRef
from storage.run_folder import RunFolder
from storage.samples import load_sample_table

__all__ = ["RunLoop", "init_ranks", "keeps_version", "idle_fractions"]

log = logging.getLogger(__name__)


def init_ranks(client, cfg: GRPOConfig, pools: Pools, policy: PolicyRef) -> None:
    """Build one training rank per train worker from ``policy`` (weights and optimiser state), the
    run's v0 as the reference, and open the weight channel (cluster.weight_sync = memory)."""
    # pp x dp x tp global ranks, each deriving its mesh coordinate from its rank. The rendezvous
    # listens on rank 0's host, on a port free there. Every worker imports the engine first, so the
    # rendezvous's train.timeout_s bounds the rendezvous only, not a cold torch import on a loaded host.
    addresses = list(pools.train_addresses)
    client.run(tasks.worker_ready, workers=addresses)
    port = client.submit(free_port, pools.train_host, workers=addresses[:1],
                         pure=False).result(timeout=cfg.cluster.worker_wait_s)
    init_method = f"tcp://{pools.train_host}:{port}"
    reference = RunFolder.at(cfg.runs_dir, cfg.run_name).policy_store().ref(0)  # whatever version resumes
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


class RunLoop:
    """Steps ``first_step`` .. iterations - 1 of a run whose ranks hold ``policy``; :meth:`run`
    returns what each step measured, in step order.

    ``host_cpu``: a callable giving the host CPU seconds since its last call (an embedded cluster's
    processes), taken once per finished step; ``on_published``: called with each version a step
    publishes (the held-out evaluation); ``machine_rate``: the host's matmul FLOP/s, against which
    each step's MFU is reported (None: no model-FLOP metrics)."""

    def __init__(self, client, cfg: GRPOConfig, pools: Pools, folder: RunFolder, policy: PolicyRef, first_step: int,
                 lineage: Lineage, progress: bool, host_cpu: Callable[[], float] | None = None,
                 on_published: Callable[[PolicyRef], None] = lambda policy: None,
                 machine_rate: float | None = None):
        self.client, self.cfg, self.pools, self.folder, self.lineage = client, cfg, pools, folder, lineage
        self.first_step, self.progress = first_step, progress
        self.host_cpu, self.on_published, self.machine_rate = host_cpu, on_published, machine_rate
        self.store = folder.rollout_store()
        self.shape = cfg.model_shape if machine_rate else None  # for the model FLOPs of each step
        self.staleness = cfg.rollout.max_staleness
        self.results: list[IterationResult] = []
        self.published: dict[int, Policy] = {policy.version: policy}  # versions the rule may still ask for
        self.in_flight: deque[PendingIteration] = deque()
        self.submitted: dict[int, tuple[int, int]] = {}  # step -> (behaviour version, submission time in epoch ms)
        self.prepared: dict[int, Future] = {}  # step -> whether prepare_step created its group
        self.queue = BackgroundQueue()  # lineage and the next step's Zarr group, while steps run
        self.dropped_below = 0  # versions below this hold no optimiser state (train.keep_optimizer_state=latest)
        self.weights_below = 1  # versions below this were looked at by drop_old_versions (v0 is always kept)
        self.failed_steps: list[int] = []  # the latest run of consecutive steps whose every reward failed
        self.plotted_at = -float("inf")  # time.monotonic() of the last redraw of the plots
        self._codec: TextCodec | None = None
        # A resumed run's plots start with the steps an earlier process logged (their stored metrics).
        self.earlier_rows = [{"step": step, **self.store.attrs(step)["metrics"]} for step in range(first_step)
                             if self.store.has_step(step) and "metrics" in self.store.attrs(step)]
        self.bar = tqdm(range(first_step, cfg.iterations), desc="iterations", disable=not progress, unit="it")

    def run(self) -> list[IterationResult]:
        try:
            for step in range(self.first_step, self.cfg.iterations):
                self.submit(step)
            self.finish_all()
            self.queue.drain()
        finally:
            self.queue.close()  # a failing run: what is queued still runs (the failed step's child run ends)
        self.bar.close()
        add_idle(self.results)
        return self.results

    # -- submit -------------------------------------------------------------------------------

    def submit(self, step: int) -> None:
        """Submit step ``step``, first finishing the steps it may not overtake. Step k asks for the
        version step k - s - 1 publishes. It is submitted while that step is still in flight, its
        tasks waiting on that step's publish task: the scheduler starts its rollout the moment the
        version is out, with no round trip through this loop."""
        cfg, s = self.cfg, self.staleness
        release = released_by(step, s)
        while self.in_flight and release is not None and self.in_flight[0].step < release:
            self.finish_oldest()
        if weight_sync.engines_moved(self.client, cfg, self.pools):  # a replaced engine rejoins the channel
            self.finish_all()  # once the training workers are idle
            weight_sync.reopen_if_engines_moved(self.client, cfg, self.pools,
                                                self.policy_for(behaviour_version(step, s)))
        version = behaviour_version(step, s)
        # A resumed run's first steps may ask for versions published by the earlier process.
        behaviour = self.policy_for(version)
        prev_train = self.in_flight[-1].train_gate if self.in_flight else ()
        self.submitted[step] = (version, int(time.time() * 1000))  # its child run opens once it has run
        self.in_flight.append(submit_iteration(self.client, cfg, self.pools, self.folder, step, behaviour, prev_train,
                                               prepared=self.take_prepared(step)))
        if step + 1 < cfg.iterations:  # its Zarr group, while this step runs
            self.prepared[step + 1] = self.queue.submit(prepare_step, cfg, self.folder, step + 1,
                                                        behaviour_version(step + 1, s))
        if self.in_flight[-1].stages["train"].gate is None:
            # Train found complete (a resumed run): the ranks restart from its version when the step
            # finishes, so no later step's training-rank task may be queued before that.
            self.finish_all()

    def policy_for(self, version: int, flight=None) -> Policy:
        """Version ``version``: published, or a :class:`PendingPolicy` when a step in ``flight``
        (default: the steps in flight) publishes it."""
        maker = next((q for q in (self.in_flight if flight is None else flight) if q.step + 1 == version), None)
        if maker is not None:
            return PendingPolicy(version, str(self.folder.policy_store().version_path(version)),
                                 maker.stages["publish"].gate, maker.done_at)
        return self.published.get(version) or self.folder.policy_store().ref(version)

    def take_prepared(self, step: int) -> bool:
        """Whether step ``step``'s group was created ahead (then it is not created again); a
        preparation that has not started is cancelled, so it never runs beside the submission."""
        future = self.prepared.pop(step, None)
        return future is not None and not future.cancel() and future.result()

    # -- finish -------------------------------------------------------------------------------

    def finish_all(self) -> None:
        while self.in_flight:
            self.finish_oldest()

    def finish_oldest(self) -> None:
        """Wait for the oldest step in flight, record what it measured, queue its lineage; a step
        that fails ends its child run FAILED and raises."""
        pending = self.in_flight.popleft()
        step = pending.step
        bar = tqdm(total=len(pending.names), desc=f"step {step}", leave=False, disable=not self.progress,
                   unit="stage")

        def advance(stage: str) -> None:
            bar.set_postfix_str(stage)
            bar.update(1)

        try:
            result = self.wait(pending, advance)
        except BaseException:
            try:  # the step's own error is the one to report, not a failed bookkeeping call's
                self.queue.submit(lambda: self.open_child(step, self.submitted[step][1]).end("FAILED"))
            except Exception as exc:
                log.warning("step %d: its child run is not marked FAILED: %s", step, exc)
            raise
        done_ms = int(time.time() * 1000)
        bar.close()
        self.record(result)
        due = len(self.results) % self.cfg.mlflow.plot_every_steps == 0
        plot = ((due and time.monotonic() >= self.plotted_at + self.cfg.mlflow.plot_min_interval_s)
                or step == self.cfg.iterations - 1)
        if plot:
            self.plotted_at = time.monotonic()
        rows = self.earlier_rows + [{"step": r.step, **r.metrics} for r in self.results] if plot else None
        self.queue.submit(self.log_step, result, rows, done_ms)
        self.check_rewards(result)  # after the step's lineage is queued: a stop still logs it
        self.bar.update(1)
        self.bar.set_postfix(reward=f"{result.metrics.get('reward_mean', float('nan')):.3f}")

    def wait(self, pending: PendingIteration, advance: Callable[[str], None]) -> IterationResult:
        """The step's result; on a lost training worker :meth:`recover` and wait for the rerun, at
        most cluster.max_restarts times."""
        limit = self.cfg.cluster.max_restarts
        for attempt in range(limit + 1):
            try:
                return finish_iteration(pending, on_stage=advance, timeout_s=self.cfg.cluster.iteration_timeout_s)
            except (WorkerLostError, ClusterError) as exc:
                # A rebuild that fails because a worker died during it is one more lost worker;
                # any other cluster failure ends the run.
                if isinstance(exc, ClusterError) and not lost_workers(self.client, self.pools):
                    raise
                if attempt == limit:
                    raise IterationError(f"{exc} (gave up after cluster.max_restarts={limit} restarts)") from exc
                pending = self.recover(pending, exc, attempt + 1)
        raise AssertionError("unreachable")

    def recover(self, pending: PendingIteration, exc: BaseException, attempt: int) -> PendingIteration:
        """Rebuild every training rank, on fresh workers, from the trainer's version of ``pending``'s
        step (weights and optimiser state) and resubmit that step and every later one in flight;
        returns the step's new submission."""
        cfg = self.cfg
        trainer = self.published.get(pending.step) or self.folder.policy_store().ref(pending.step)
        log.warning("%s; rebuilding every training rank from policy v%d and rerunning step %d "
                    "(restart %d of %d)", exc, trainer.version, pending.step, attempt, cfg.cluster.max_restarts)
        later = list(self.in_flight)
        for q in (pending, *later):
            q.cancel()
        self.pools = restart_train_workers(self.client, cfg, self.pools)
        init_ranks(self.client, cfg, self.pools, trainer)
        self.in_flight.clear()
        pending = submit_iteration(self.client, cfg, self.pools, self.folder, pending.step,
                                   self.policy_for(pending.policy.version), attempt=attempt)
        prev, resubmitted = pending.train_gate, [pending]
        for q in later:  # a version a resubmitted step publishes: its new publish task
            self.in_flight.append(submit_iteration(self.client, cfg, self.pools, self.folder, q.step,
                                                   self.policy_for(q.policy.version, resubmitted), prev,
                                                   attempt=attempt))
            prev = self.in_flight[-1].train_gate
            resubmitted.append(self.in_flight[-1])
        return pending

    def record(self, result: IterationResult) -> None:
        """Add what the driver measures of a finished step to its metrics (host CPU, staleness of
        the consumed rows, model FLOPs and MFU) and publish its version to the loop."""
        step = result.step
        if "train" in result.skipped:
            # The shards came from an earlier process; the ranks still hold the step's input
            # policy, so they restart from the version just published.
            init_ranks(self.client, self.cfg, self.pools, result.policy)
        result.metrics["publish_seconds_total"] = result.stage_seconds["publish"]
        if self.host_cpu is not None:  # embedded cluster: every process of the run is on this host
            result.metrics["host_cpu_seconds"] = self.host_cpu()
        # Staleness of the consumed rows: trainer version minus each row's behaviour version.
        lag = trainer_version(step) - self.store.read(step, "policy_version")["policy_version"].astype(np.int64)
        result.metrics["staleness_mean"], result.metrics["staleness_max"] = float(lag.mean()), float(lag.max())
        if self.machine_rate:
            result.metrics.update(self.model_flops_metrics(result))
        self.published[result.policy.version] = result.policy
        self.on_published(result.policy)
        self.results.append(result)

    def model_flops_metrics(self, result: IterationResult) -> dict[str, float]:
        """The step's model FLOPs per phase (from its stored prompt and completion lengths) and its
        MFU against the machine's rate (stages/perf)."""
        a = self.store.read(result.step, "prompt_len", "length", "reward_failed")
        G = self.cfg.rollout.group_size
        flops = step_model_flops(self.shape, a["prompt_len"], a["length"], group_size=G,
                                 reference="reference" in result.stage_seconds,
                                 trained=trained_samples(~a["reward_failed"], G))
        return step_mfu_metrics(flops, result.stage_seconds, result.metrics.get("iteration_seconds", 0.0),
                                self.machine_rate)

    def check_rewards(self, result: IterationResult) -> None:
        """Say when a step's rewards failed, with the first reason; stop the run once
        reward.max_failed_steps consecutive steps had every sample's reward fail (they train nothing)."""
        cfg, failed_steps = self.cfg, self.failed_steps
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

    # -- log (on the background queue's thread) -----------------------------------------------

    def open_child(self, step: int, start_ms: int) -> StepRun:
        """The step's child run, opened once the step has run (its start: ``start_ms``); an
        interrupted process may have left one for the steps it had in flight (s + 2)."""
        version, _ = self.submitted.pop(step)
        return self.lineage.start_step(step, version, start_time_ms=start_ms,
                                       reopen=step <= self.first_step + self.staleness + 1)

    def codec(self, policy_path: str) -> TextCodec:
        """The run's tokenizer, read once: every version is published with the base policy's."""
        if self._codec is None:
            self._codec = TextCodec.from_policy_folder(policy_path, self.cfg.dataset.chat_template,
                                                       self.cfg.dataset.system_prompt)
        return self._codec

    def log_step(self, result: IterationResult, plot_rows: list[dict] | None, done_ms: int) -> None:
        """The step's lineage, then its "lineage" mark: written last, with the step's metrics for
        summary.json, it says the step needs no rerun. The child run spans the step's own work:
        from its first task's start (its submission, when every task was found done) to the moment
        it finished, not the logging after."""
        cfg, folder, store = self.cfg, self.folder, self.store
        t0 = time.perf_counter()
        step = result.step
        trace_path = folder.save_trace(step, result.trace_events)
        # Not before its submission: a resumed step's stored results carry an earlier process's times.
        submitted_s = self.submitted[step][1] / 1000
        started = max(min((start for _, start, _ in result.busy), default=submitted_s), submitted_s)
        child = self.open_child(step, int(started * 1000))
        child.end_time_ms = done_ms
        with child:  # decoded samples, timeline, dataset with schema, metrics and policy; ends the child run
            policy_codec = self.codec(result.policy.path)
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
            self.lineage.log_plots(save_run_plots(plot_rows, folder.plots, STAGES))
        if step % cfg.mlflow.plot_every_steps == 0 and table["id"]:  # one decoded example now and then
            tqdm.write(f"{table['id'][0]} (policy v{table['policy_version'][0]}): {table['prompt'][0]!r} -> "
                       f"{table['completion'][0]!r}, reward {table['reward'][0]:.2f}, "
                       f"advantage {table['advantage'][0]:+.2f}")
        metrics = {k: float(v) for k, v in result.metrics.items()}
        metrics["lineage_seconds"] = time.perf_counter() - t0
        store.mark_complete(step, "lineage", metrics=metrics, mlflow_run_id=child.run_id)
        self.drop_optimizer_state(step)
        self.drop_old_versions(step + 1)

    def drop_optimizer_state(self, step: int) -> None:
        """train.keep_optimizer_state=latest, once step ``step`` is logged: steps are logged in
        order, so a resume now starts at step + 1, from the version this step published, or later.
        The version it started from keeps its state too, so that a rerun of this step (its group
        deleted) can still start from it; the ones before are never loaded again (from v0 on the
        first call: a process killed between a mark and its drop left one behind)."""
        if self.cfg.train.keep_optimizer_state != "latest":
            return
        for version in range(self.dropped_below, step):
            self.folder.policy_store().drop_optimizer_state(version)
        self.dropped_below = max(self.dropped_below, step)

    def drop_old_versions(self, latest: int) -> None:
        """train.keep_versions: delete the weights of the versions older than the newest N that no
        rule keeps (:func:`keeps_version`), once ``latest`` is published and its step logged."""
        cfg = self.cfg
        if cfg.train.keep_versions is None:
            return
        n = max(cfg.train.keep_versions, self.staleness + 2)  # the versions a resumed or in-flight step may start from
        store = self.folder.policy_store()
        for version in range(self.weights_below, latest - n + 1):
            if not keeps_version(cfg, version) and store.is_complete(version):
                freed = store.drop_version(version)
                log.debug("policy v%d: weights deleted (train.keep_versions=%d), %d bytes freed", version, n, freed)
        self.weights_below = max(self.weights_below, latest - n + 1)


def keeps_version(cfg: GRPOConfig, version: int) -> bool:
    """Whether policy ``version`` stays whole whatever its age (train.keep_versions): v0 (the
    reference), every train.keep_every-th, every one the held-out evaluation scores, the run's last."""
    every = cfg.train.keep_every
    evaluated = cfg.eval.enabled and bool(cfg.eval.every_steps) and version % cfg.eval.every_steps == 0
    return version in (0, cfg.iterations) or bool(every and version % every == 0) or evaluated


def _idle_seconds(busy: list[tuple[float, float]], lo: float, hi: float) -> float:
    """Seconds of [lo, hi] covered by none of the ``busy`` (start, end) intervals."""
    covered, cursor = 0.0, lo
    for a, b in sorted((max(a, lo), min(b, hi)) for a, b in busy if b > lo and a < hi):
        if b > cursor:
            covered += b - max(a, cursor)
            cursor = b
    return max(0.0, (hi - lo) - covered)


def idle_fractions(results: list[IterationResult]) -> dict[str, float]:
    """Idle seconds of each pool over the run's step windows, as fractions (the per-step idle
    seconds reach the step metrics and summary.json only: they are known once every step has run)."""
    window = sum(r.metrics.get("step_window_seconds", 0.0) for r in results)
    if window <= 0:
        return {}
    return {f"{pool}_idle_fraction": sum(r.metrics.get(f"{pool}_idle_seconds", 0.0) for r in results) / window
            for pool in ("rollout", "train")}


def add_idle(results: list[IterationResult]) -> None:
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
