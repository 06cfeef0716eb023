"""A worker killed (SIGKILL) mid-run: the run finishes without a hang, no group is lost or
duplicated, and a lost rollout engine changes nothing in the final weights. The runs send versions
in memory (cluster.weight_sync=memory): a lost worker's channel is replaced by a new one."""

from __future__ import annotations

import json
import logging
import os
import signal
import time
from dataclasses import replace
from pathlib import Path

import dask
import pytest

from benchmarks.faults import Trial, _Restarts, base_config, check_groups, final_sha, run_trial
from flows.cluster import start_cluster, worker_addresses
from flows.config import ConfigError, load_config
from flows.loop import run, run_folder

ITERATIONS = 4  # the channel a lost engine left is reopened before step 3


def test_max_restarts_must_not_be_negative():
    with pytest.raises(ConfigError, match="cluster.max_restarts must be >= 0"):
        load_config("configs/tiny.yaml", ["cluster.max_restarts=-1"])


def test_a_worker_restarting_longer_than_the_lost_worker_timeout_comes_back(tmp_path):
    """Dask's SpecCluster closes the nanny of a worker still missing ``lost-worker-timeout`` after it
    died, killing the nanny's restart in progress; the embedded cluster keeps its nannies. A
    restart (a new Python process) takes far longer than the 0.1 s timeout set here."""
    cfg = load_config("configs/tiny.yaml", [f"runs_dir={tmp_path}", "cluster.placement=decoupled",
                                            "rollout.num_engines=1"])
    with dask.config.set({"distributed.deploy.lost-worker-timeout": "0.1s"}):
        client, cluster = start_cluster(cfg)
        try:
            for kill in range(2):
                address = worker_addresses(client)["plain-0"]
                os.kill(client.run(os.getpid, workers=[address])[address], signal.SIGKILL)
                deadline = time.monotonic() + 60
                while worker_addresses(client).get("plain-0") in (None, address):
                    assert time.monotonic() < deadline, f"plain-0 did not come back after kill {kill}"
                    time.sleep(0.1)
                time.sleep(1.0)  # ten timeouts: a nanny closed by the timer would have taken its worker down
                assert set(worker_addresses(client)) == {"train-0", "train-1", "rollout-0", "plain-0"}, kill
        finally:
            client.close()
            cluster.close()


@pytest.fixture(scope="module")
def cluster_run(tmp_path_factory):
    """A shared embedded cluster and the fault-free run's final weights."""
    cfg = base_config(str(tmp_path_factory.mktemp("runs")), ITERATIONS)
    # Versions travel in memory too: a lost engine or rank must reopen the channel or load from disk.
    cfg = replace(cfg, cluster=replace(cfg.cluster, weight_sync="memory", weight_sync_timeout_s=20.0))
    client, cluster = start_cluster(cfg)
    cfg = replace(cfg, cluster=replace(cfg.cluster, scheduler_address=cluster.scheduler_address))
    restarts = _Restarts()
    logging.getLogger("flows.run_loop").addHandler(restarts)
    try:
        reference = replace(cfg, run_name="fault-free")
        run(reference, progress=False)
        assert check_groups(reference) == (0, 0, 0)
        yield client, cfg, final_sha(reference), restarts
    finally:
        logging.getLogger("flows.run_loop").removeHandler(restarts)
        client.close()
        cluster.close()


@pytest.mark.slow
def test_killing_the_rollout_worker_mid_rollout_changes_nothing(cluster_run):
    client, cfg, reference_sha, restarts = cluster_run
    trial = run_trial(client, replace(cfg, run_name="kill-rollout"), Trial(0, "rollout-0", 1, "rollout", 0.0),
                      reference_sha, restarts)
    assert trial.killed_during == "step=1/rollout", trial
    assert trial.finished, trial.error
    assert (trial.lost_groups, trial.duplicated_groups, trial.incomplete_steps) == (0, 0, 0)
    assert trial.restarts == 0  # the engine is replaced by Dask; the training ranks are untouched
    assert trial.same_weights
    # v2 was sent to the dead engine: that send failed, the channel was closed, and v2 came from
    # disk. Step 2 was submitted while step 1 ran, before the engine was back, so v3 was not sent
    # and came from disk too; the channel was reopened with the replaced engine before step 3 (once
    # the steps in flight had finished), whose send of v4 went through.
    metrics = _metrics(replace(cfg, run_name="kill-rollout"))
    assert metrics[1]["weight_sync_memory_send_failures"] >= 1 and metrics[2]["weight_loads_from_disk"] == 1
    assert metrics[2]["weight_sync_memory_send_bytes"] == 0 and metrics[3]["weight_loads_from_disk"] == 1
    assert metrics[3]["weight_sync_memory_send_failures"] == 0 and metrics[3]["weight_sync_memory_send_bytes"] > 0


@pytest.mark.slow
def test_killing_a_training_rank_mid_train_reruns_the_step(cluster_run):
    client, cfg, reference_sha, restarts = cluster_run
    trial = run_trial(client, replace(cfg, run_name="kill-train"), Trial(1, "train-1", 1, "train", 0.0),
                      reference_sha, restarts)
    assert trial.killed_during == "step=1/train", trial
    assert trial.finished, trial.error
    assert trial.restarts == 1, trial
    assert (trial.lost_groups, trial.duplicated_groups, trial.incomplete_steps) == (0, 0, 0)
    # No bound on the time beyond the run finishing: every wait is bounded by its own timeout.
    assert trial.wall_s < cfg.cluster.iteration_timeout_s
    # The rebuilt ranks opened a new channel: step 1's rerun sent v2 on it, and step 2 took it from memory.
    metrics = _metrics(replace(cfg, run_name="kill-train"))
    assert metrics[2]["weight_loads_from_memory"] == 1 and metrics[2]["weight_sync_memory_send_failures"] == 0


def _metrics(cfg) -> list[dict]:
    return json.loads(Path(run_folder(cfg).summary).read_text())["metrics"]


def _sleep(seconds: float) -> float:
    time.sleep(seconds)
    return seconds


def test_the_timeout_message_names_the_late_stage_and_the_worker_it_waited_for():
    from distributed import Client, LocalCluster

    from flows.iteration import StageFutures, _late_message

    with LocalCluster(n_workers=1, processes=False, threads_per_worker=1, dashboard_address=None) as cluster, \
            Client(cluster) as client:
        (address,) = client.scheduler_info()["workers"]
        running = client.submit(_sleep, 2.0, key="train-0-x", workers=[address])
        starved = client.submit(_sleep, 0.0, key="rollout-0-x", resources={"rollout": 1})
        time.sleep(0.5)  # the first task is on the worker by now
        stages = {s: StageFutures(s) for s in ("rollout", "reward", "reference", "advantage", "train", "publish")}
        stages["train"] = StageFutures("train", (running,))
        message = _late_message(client, 3, stages, {running}, 60.0)
        assert message == (f"step 3: stages train did not finish within cluster.iteration_timeout_s=60 s; "
                           f"stage train waited for worker 0 ({address}) running train-0-x")
        stages["rollout"] = StageFutures("rollout", (starved,))
        message = _late_message(client, 3, stages, {running, starved}, 60.0)
        assert message.startswith("step 3: stages rollout, train did not finish")
        assert message.endswith("stage rollout waited for a worker with resource rollout for rollout-0-x (no-worker)")


@pytest.mark.slow
def test_a_frozen_training_rank_is_killed_and_the_step_rerun(cluster_run):
    """SIGSTOP: the rank's process stays up, its heartbeats stop. Its peer's send times out at
    train.timeout_s; the rank is lost once silent for cluster.worker_silence_s, its nanny kills it,
    and the step reruns on rebuilt ranks, to the fault-free weights. Nothing waits for Dask's own
    five-minute worker TTL."""
    client, cfg, reference_sha, restarts = cluster_run
    cfg = replace(cfg, run_name="freeze-train", cluster=replace(cfg.cluster, worker_silence_s=15.0))
    trial = run_trial(client, cfg, Trial(2, "train-1", 1, "train", 0.0, sends=signal.SIGSTOP), reference_sha,
                      restarts)
    assert trial.killed_during == "step=1/train", trial
    assert trial.finished, trial.error
    assert trial.restarts == 1, trial
    assert (trial.lost_groups, trial.duplicated_groups, trial.incomplete_steps) == (0, 0, 0)
    assert trial.same_weights
    assert trial.wall_s < cfg.cluster.iteration_timeout_s  # four steps, a freeze, a rebuild and a rerun


def test_clean_up_does_not_wait_on_a_frozen_worker(caplog):
    from distributed import Client, LocalCluster

    from flows.cluster import run_on_workers

    with LocalCluster(n_workers=2, processes=True, threads_per_worker=1, dashboard_address=None) as cluster, \
            Client(cluster) as client:
        frozen, other = sorted(client.scheduler_info()["workers"])
        pid = client.run(os.getpid, workers=[frozen])[frozen]
        os.kill(pid, signal.SIGSTOP)
        try:
            t0 = time.monotonic()  # not silent long yet: asked, and given up on at the timeout
            run_on_workers(client, os.getpid, timeout_s=2.0, quiet_s=30.0)
            assert 2.0 <= time.monotonic() - t0 < 10.0
            assert "getpid did not finish on every worker within 2 s" in caplog.text
            time.sleep(3.0)  # past quiet_s: not asked at all
            t0 = time.monotonic()
            run_on_workers(client, os.getpid, timeout_s=30.0, quiet_s=2.0)
            assert time.monotonic() - t0 < 10.0
            name = {a: w["name"] for a, w in client.scheduler_info()["workers"].items()}[frozen]
            assert f"getpid on every worker but {name} ({frozen}), silent for more than 2 s" in caplog.text
        finally:
            os.kill(pid, signal.SIGCONT)
