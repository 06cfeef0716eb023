"""Fault harness: kill a random worker (SIGKILL) at a random point of a random stage of a short run.

Every trial runs the same short config on one shared embedded cluster (its nannies restart a killed
worker process under the same name): a killer thread waits until the chosen stage of the chosen
step has started (its inputs are marked complete in the rollout store), sleeps a random fraction of
that stage's median duration in the fault-free run and kills the chosen worker's process by pid
(``client.run(os.getpid)``, keyed by worker name). The target is rollout-0, plain-0, a random
training rank, or ``reward``: the last worker seen holding one of the step's reward (``score-``, or
``rollout-`` with reward.in_rollout) tasks when the kill lands, running it or holding its result
(reward tasks of a synchronous run may go to any worker). Then it checks the run folder:

- finished: the run returned (no hang: every wait is bounded by its configured timeout);
- groups: every step's ``group_id`` holds each expected group exactly once (G contiguous rows) and
  every stage of every step is marked complete; lost / duplicated groups are counted;
- weights: the final policy version's sha256 equals the fault-free run's.

    PYTHONPATH=. .venv/bin/python benchmarks/faults.py [--trials 20] [--seed 0] [--iterations 3]
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import random
import signal
import statistics
import tempfile
import threading
import time
from collections import Counter
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import numpy as np

from flows.cluster import start_cluster, worker_addresses
from flows.config import GRPOConfig, load_config
from flows.iteration import STAGES, inside_stages, stage_inputs, step_stages
from flows.loop import run, run_folder
from stages.rollout.rows import first_group_id

_POLL_S = 0.005  # the killer's look at the store; tiny stages last ~0.05-2 s


@dataclass
class Trial:
    index: int
    target: str
    """Worker to kill: rollout-0, plain-0, train-<rank>, or reward (the worker holding a reward task)."""
    step: int
    stage: str
    """The stage whose start armed the kill."""
    delay_s: float
    """From the stage's start to the kill: a uniform fraction of its median fault-free duration."""
    sends: int = signal.SIGKILL
    """What the kill sends: SIGKILL (a death) or SIGSTOP (a frozen process, which stays up, silent)."""
    killed: str = ""
    """Name of the worker killed ('' if none was)."""
    killed_during: str = ""
    """step=<s>/<stage>: the first stage not yet complete when the kill landed ('' if never armed)."""
    finished: bool = False
    error: str = ""
    lost_groups: int = 0
    duplicated_groups: int = 0
    incomplete_steps: int = 0
    same_weights: bool = False
    restarts: int = 0
    wall_s: float = 0.0
    previous_not_back: str = ""
    """Set when the worker killed in the previous trial had not come back before this one."""


def base_config(runs_dir: str, iterations: int) -> GRPOConfig:
    """A short run: 8 prompts x G 8, two pipeline ranks, one rollout engine of its own (a worker of
    each kind to kill); bounded waits so a failure cannot hang."""
    return load_config("configs/tiny.yaml", [
        f"iterations={iterations}", f"runs_dir={runs_dir}", "warmup.steps=30", "task.prompts_per_step=8",
        "cluster.placement=decoupled", "rollout.num_engines=1",
        "train.micro_batch_size=16", "train.timeout_s=10", "cluster.iteration_timeout_s=120",
        "cluster.worker_wait_s=180"])  # a restarted worker imports torch again: slow on a loaded host


def check_groups(cfg: GRPOConfig) -> tuple[int, int, int]:
    """(lost groups, duplicated groups, steps with a stage not marked complete) of a finished run."""
    store = run_folder(cfg).rollout_store()
    P, G = cfg.task.prompts_per_step, cfg.rollout.group_size
    lost = dup = incomplete = 0
    for step in range(cfg.iterations):
        if not store.has_step(step):
            lost, incomplete = lost + P, incomplete + 1
            continue
        incomplete += not set(STAGES) <= store.completed(step)
        ids = store.read(step, "group_id")["group_id"]
        expected = first_group_id(step, P, 0) + np.arange(P)
        rows = ids.reshape(-1, G)
        whole = np.all(rows == rows[:, :1], axis=1)  # a group's G rows carry one id
        counts = Counter(rows[whole, 0].tolist())
        lost += sum(counts.get(int(g), 0) == 0 for g in expected)
        dup += sum(n > 1 for n in counts.values()) + int((~whole).sum())
    return lost, dup, incomplete


def final_sha(cfg: GRPOConfig) -> str:
    return run_folder(cfg).policy_store().ref(cfg.iterations).sha256


class _Restarts(logging.Handler):
    """Counts the loop's 'rebuilding every training rank' warnings."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.count = 0

    def emit(self, record: logging.LogRecord) -> None:
        self.count += "rebuilding every training rank" in record.getMessage()


def _running(store, cfg: GRPOConfig, first_step: int) -> str:
    """The first incomplete stage at or after ``first_step``, as step=<s>/<stage>."""
    inside = inside_stages(cfg)  # marked with their hosts or later: not where the step is
    for step in range(first_step, cfg.iterations):
        done = store.completed(step) if store.has_step(step) else set()
        stage = next((s for s in STAGES if s not in done and s not in inside), None)
        if stage is not None:
            return f"step={step}/{stage}"
    return "after the last step"


def _scoring_worker(client, cfg: GRPOConfig, step: int, until: float, stop: threading.Event) -> str | None:
    """The last worker seen holding one of the step's reward tasks by ``until`` (time.monotonic):
    one running it then, or else the one that ran it and holds its result; None if none was seen.
    With reward.in_rollout the rollout tasks score: they are the reward tasks."""
    prefix, seen = f"{'rollout' if cfg.reward.in_rollout else 'score'}-{step}-", None
    while not stop.is_set():
        holding = [a for a, keys in client.processing().items() if any(str(k).startswith(prefix) for k in keys)]
        seen = holding[0] if holding else seen
        if time.monotonic() >= until:
            return seen
        time.sleep(_POLL_S / 4)
    return None


def _inputs(cfg: GRPOConfig, stage: str) -> set[str]:
    """The stages whose marks say ``stage`` has started: those it waits for in the config's graph."""
    inside = inside_stages(cfg)
    return set(stage_inputs(inside)[stage]) & (set(step_stages(cfg)) - set(inside))


def _kill_when_started(client, cfg: GRPOConfig, trial: Trial, stop: threading.Event) -> None:
    store = run_folder(cfg).rollout_store()
    target = None
    if trial.target != "reward":
        # Found before the stage starts (the workers are up when a trial starts): a stage that
        # starts the moment the one before it publishes is short, and two scheduler round trips
        # after it started could land past its end.
        try:
            address = worker_addresses(client)[trial.target]
            target = (address, client.run(os.getpid, workers=[address])[address])
        except Exception as exc:  # the target is itself restarting: no kill
            trial.killed, trial.killed_during = "", f"not killed ({type(exc).__name__})"
            return
    while not stop.is_set():
        try:
            done = store.completed(trial.step) if store.has_step(trial.step) else None
            # The loop creates a step's group while the step before runs: the step has started
            # once that one is published (the synchronous loop submits it then).
            if trial.step > 0 and "publish" not in store.completed(trial.step - 1):
                done = None
        except Exception:  # attrs mid-write: look again
            done = None
        if done is not None and _inputs(cfg, trial.stage) <= done:
            break
        time.sleep(_POLL_S)
    else:
        return
    if trial.target == "reward":
        address = _scoring_worker(client, cfg, trial.step, time.monotonic() + trial.delay_s, stop)
        if address is None:
            trial.killed_during = "not killed (no reward task seen)"
            return
        try:
            trial.killed = {a: n for n, a in worker_addresses(client).items()}.get(address, "")
            pid = client.run(os.getpid, workers=[address])[address]
        except Exception as exc:  # the target is itself restarting: no kill
            trial.killed, trial.killed_during = "", f"not killed ({type(exc).__name__})"
            return
    else:
        time.sleep(trial.delay_s)
        (address, pid), trial.killed = target, trial.target
    os.kill(pid, trial.sends)
    try:  # the killed worker's stage stays incomplete: read after the kill, off its critical moment
        trial.killed_during = _running(store, cfg, max(0, trial.step - 1))
    except Exception:  # attrs mid-write
        trial.killed_during = f"step={trial.step}"


def run_trial(client, cfg: GRPOConfig, trial: Trial, reference_sha: str, restarts: _Restarts) -> Trial:
    stop = threading.Event()
    killer = threading.Thread(target=_kill_when_started, args=(client, cfg, trial, stop), daemon=True)
    before = restarts.count
    # A worker killed at the end of the previous trial may still be restarting; one whose nanny
    # has not brought it back in cluster.worker_wait_s is recorded, and the cluster restarted.
    try:
        client.wait_for_workers(cfg.train.world_size + cfg.rollout.num_engines + cfg.cluster.num_plain_workers,
                                timeout=cfg.cluster.worker_wait_s)
    except Exception as exc:
        trial.previous_not_back = f"{type(exc).__name__}: {exc}"[:120]
        client.restart()
    t0 = time.perf_counter()
    killer.start()
    try:
        run(cfg, progress=False)
        trial.finished = True
    except Exception as exc:
        trial.error = f"{type(exc).__name__}: {str(exc)[:200]}"
    finally:
        stop.set()
        killer.join()
    trial.wall_s = time.perf_counter() - t0
    trial.restarts = restarts.count - before
    if trial.finished:
        trial.lost_groups, trial.duplicated_groups, trial.incomplete_steps = check_groups(cfg)
        trial.same_weights = final_sha(cfg) == reference_sha
    return trial


def plan(rng: random.Random, index: int, cfg: GRPOConfig, stage_seconds: dict[str, list[float]]) -> Trial:
    """A random worker, step, stage, and point in that stage: within the stage's median duration over
    the fault-free run's steps (``stage_seconds``: one value per step; a step's own can be an outlier)."""
    kind = rng.choice(("rollout", "reward", "plain", "train"))
    target = {"rollout": "rollout-0", "reward": "reward", "plain": "plain-0",
              "train": f"train-{rng.randrange(cfg.train.world_size)}"}[kind]
    step, stage = rng.randrange(cfg.iterations), rng.choice(STAGES)
    if kind == "reward":  # a reward task runs only during the reward stage (the rollout's, scored in it)
        stage = "rollout" if cfg.reward.in_rollout else "reward"
    return Trial(index, target, step, stage, round(rng.uniform(0, statistics.median(stage_seconds[stage])), 3))


def table(trials: list[Trial]) -> str:
    lines = ["| trial | target | killed | armed at | landed in | finished | rank rebuilds | lost | dup | "
             "same weights | s |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for t in trials:
        lines.append(f"| {t.index} | {t.target} | {t.killed or '-'} | step={t.step}/{t.stage} +{t.delay_s:.2f} s | "
                     f"{t.killed_during or '-'} | "
                     f"{'yes' if t.finished else 'NO: ' + t.error} | {t.restarts} | {t.lost_groups} | "
                     f"{t.duplicated_groups} | {'yes' if t.same_weights else 'no'} | {t.wall_s:.0f} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trials", type=int, default=20)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--iterations", type=int, default=3)
    ap.add_argument("--runs-dir", default=None, help="default: a temporary folder")
    ap.add_argument("--json", default=None, help="also write the trials here")
    args = ap.parse_args()
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    restarts = _Restarts()
    logging.getLogger("flows.run_loop").addHandler(restarts)
    runs_dir = args.runs_dir or tempfile.mkdtemp(prefix="grpoflow-faults-")
    cfg = base_config(runs_dir, args.iterations)
    client, cluster = start_cluster(cfg)
    cfg = replace(cfg, cluster=replace(cfg.cluster, scheduler_address=cluster.scheduler_address))
    t0 = time.perf_counter()
    try:
        ref_cfg = replace(cfg, run_name="fault-free")
        summary = run(ref_cfg, progress=False)
        reference_sha = final_sha(ref_cfg)
        assert check_groups(ref_cfg) == (0, 0, 0), "the fault-free run itself lost or duplicated groups"
        print(f"fault-free run: {time.perf_counter() - t0:.0f} s, final weights sha256 {reference_sha[:16]}")
        rng = random.Random(args.seed)
        trials = []
        for i in range(args.trials):
            trial = plan(rng, i, cfg, summary.stage_seconds)
            trial = run_trial(client, replace(cfg, run_name=f"trial-{i}"), trial, reference_sha, restarts)
            trials.append(trial)
            print(json.dumps(asdict(trial)), flush=True)
            if args.json:  # as it goes: an interrupted harness keeps its trials
                Path(args.json).write_text(json.dumps([asdict(t) for t in trials], indent=1))
            if not trial.finished:  # a failed run may leave aborted process groups behind
                client.restart()
    finally:
        client.close()
        cluster.close()
    print(table(trials))
    ok = [t for t in trials if t.finished]
    print(f"{len(ok)}/{len(trials)} runs finished; lost groups {sum(t.lost_groups for t in ok)}, duplicated "
          f"{sum(t.duplicated_groups for t in ok)}, incomplete steps {sum(t.incomplete_steps for t in ok)}; "
          f"final weights equal the fault-free run's in {sum(t.same_weights for t in ok)}/{len(ok)} "
          f"({time.perf_counter() - t0:.0f} s in all)")
    if args.json:
        Path(args.json).write_text(json.dumps([asdict(t) for t in trials], indent=1))


if __name__ == "__main__":
    main()
