"""rollout.max_staleness = 0 through the loop (flows/loop.py ``run``) is the plain synchronous path:
flows.iteration.run_iteration called step after step over the same config gives the same Zarr arrays
and the same policy weights, bit for bit. Both use cluster.weight_sync = memory, so the engine
generates from the weights it received, and the test checks that it did: each received version's
content hash is that of the published folder's tensors. A run stopped after 2 iterations and
resumed to 3 gives the same arrays and weights too, under a warm-up and cosine learning-rate
schedule whose per-step rates (the metric ``lr``) are ``lr_at``'s."""

from __future__ import annotations

import ipaddress
from collections import Counter
from dataclasses import replace
from pathlib import Path

import pytest

from conftest import ListeningSockets, assert_loaded_from, assert_same_runs
from flows import tasks
from flows.cluster import check_pools, start_cluster
from flows.config import load_config
from flows.iteration import run_iteration
from flows.loop import run, run_folder
from flows.run_loop import init_ranks
from stages.sync import state_digest
from stages.train.schedule import lr_at
from storage.policies import load_model_folder

pytestmark = pytest.mark.slow

ITERATIONS = 3
ENGINES = 2  # as configs/tiny.yaml: colocated with the two training ranks
_SOCKETS: set[tuple[int, str, int]] = set()  # (pid, ip, port) listening while the loop ran


def _config(runs_dir: Path):
    return load_config("configs/tiny.yaml", [
        f"iterations={ITERATIONS}", "run_name=sync", f"runs_dir={runs_dir}", "warmup.steps=100",
        "task.prompts_per_step=8", "train.micro_batch_size=16", "rollout.max_staleness=0",
        "cluster.weight_sync=memory", f"rollout.num_engines={ENGINES}", "cluster.placement=colocated",
        # A rate that differs at every step (lr / 2, lr, 0.55 lr): a resume at the wrong one differs.
        # lr_decay_steps is set because the resumed run first runs with iterations=2.
        "train.lr_schedule=cosine", "train.lr_warmup_steps=1", "train.lr_decay_steps=2", "train.lr_min_ratio=0.1"])


def _step_by_step(client, cfg, pools) -> None:
    """The synchronous reference: build the ranks, then run_iteration(step k) from the version step
    k - 1 published."""
    folder = run_folder(cfg).create()
    policy = client.submit(tasks.make_base_policy, cfg, folder, workers=[pools.train_addresses[0]],
                           pure=False).result()
    init_ranks(client, cfg, pools, policy)
    try:
        for step in range(cfg.iterations):
            policy = run_iteration(client, cfg, pools, folder, step, policy,
                                   timeout_s=cfg.cluster.iteration_timeout_s).policy
            assert policy.version == step + 1
    finally:
        client.run(tasks.shutdown_train_rank, cfg.run_name)


@pytest.fixture(scope="module")
def two_paths(tmp_path_factory):
    """(loop run's folder, its summary, step-by-step folder) on one shared embedded cluster."""
    cfg = _config(tmp_path_factory.mktemp("loop"))
    client, cluster = start_cluster(cfg)
    try:
        shared = replace(cfg.cluster, scheduler_address=cluster.scheduler_address)
        loop_cfg = replace(cfg, cluster=shared)
        with ListeningSockets() as sockets:
            summary = run(loop_cfg, progress=False)
        _SOCKETS.update(sockets.seen)
        ref_cfg = replace(loop_cfg, runs_dir=str(tmp_path_factory.mktemp("reference")))
        _step_by_step(client, ref_cfg, check_pools(client, ref_cfg))
        # Resumed: 2 iterations, then the same run to 3 (a new driver-side channel from v2).
        resumed_cfg = replace(loop_cfg, runs_dir=str(tmp_path_factory.mktemp("resumed")), iterations=2)
        run(resumed_cfg, progress=False)
        resumed = run(replace(resumed_cfg, iterations=ITERATIONS), progress=False)
        yield (Path(run_folder(loop_cfg).root), summary, Path(run_folder(ref_cfg).root),
               Path(run_folder(resumed_cfg).root), resumed)
    finally:
        client.close()
        cluster.close()


def test_every_socket_of_the_run_listens_on_loopback(two_paths):
    """The scheduler, nannies, workers, their dashboards, the training ranks' process-group store
    and the weight sync's store: Dask's protocol runs code for whoever reaches a worker, and the
    TCPStores take writes from anyone, so none may listen beyond this machine."""
    exposed = sorted({(ip, port) for _, ip, port in _SOCKETS if not ipaddress.ip_address(ip).is_loopback})
    assert not exposed, f"listening beyond loopback: {exposed}"
    per_process = Counter(pid for pid, _, _ in _SOCKETS)
    # The check saw the run: the driver (scheduler, its dashboard, nannies) and each worker
    # (two training workers, one plain: comm, dashboard), rank 0's also hosting the two TCPStores.
    assert len(per_process) >= 1 + ENGINES + 1 and max(per_process.values()) >= 4, per_process


def _same_run(loop_dir: Path, ref_dir: Path) -> None:
    assert_same_runs(loop_dir, ref_dir, ITERATIONS, ITERATIONS + 1)  # policy v0 .. v3, both pipeline shards


def test_the_synchronous_loop_equals_run_iteration_step_by_step(two_paths):
    loop_dir, _, ref_dir, _, _ = two_paths
    _same_run(loop_dir, ref_dir)


def test_a_resumed_memory_sync_run_equals_the_uninterrupted_one(two_paths):
    loop_dir, _, _, resumed_dir, resumed = two_paths
    _same_run(loop_dir, resumed_dir)
    # The resumed process built its ranks from v2 and opened a new channel: step 2 read v2 from disk.
    loaded = assert_loaded_from(resumed_dir, 2, "disk", ENGINES)
    assert (resumed.metrics[2]["weight_loads_from_memory"], resumed.metrics[2]["weight_loads_from_disk"]) == (0, len(loaded))


def test_each_step_trained_at_the_scheduled_rate(two_paths):
    loop_dir, summary, _, _, resumed = two_paths
    train = _config(loop_dir).train
    expected = [lr_at(train, k, ITERATIONS) for k in range(ITERATIONS)]
    assert expected == pytest.approx([train.lr / 2, train.lr, 0.55 * train.lr])
    assert [m["lr"] for m in summary.metrics] == expected
    assert [m["lr"] for m in resumed.metrics] == expected  # steps 0-1 from the first process, 2 from the resume


def test_the_engine_generated_from_the_weights_it_received(two_paths):
    loop_dir, summary, *_ = two_paths
    for step, m in enumerate(summary.metrics):
        # Step k sends v(k+1); step k >= 1 generates from v(k), received in memory (v0 is the
        # version the ranks were built from: disk).
        assert m["weight_sync_memory_send_failures"] == 0 and m["weight_sync_memory_send_bytes"] > 0
        assert m["publish_bytes"] > 0 and "publish_write_seconds" in m and m["pipeline_p2p_bytes"] > 0
        loaded = assert_loaded_from(loop_dir, step, "disk" if step == 0 else "memory", ENGINES)
        assert (m["weight_loads_from_memory"], m["weight_loads_from_disk"]) == ((0, len(loaded)) if step == 0
                                                                                  else (len(loaded), 0))
        if step == 0:
            assert m["weight_load_disk_seconds"] > 0
            continue
        assert m["weight_sync_memory_receive_bytes"] == m["weight_sync_memory_send_bytes"]
        _, _, tensors = load_model_folder(loop_dir / "policy" / f"v{step}")
        assert all(r["weights_content_hash"] == state_digest(tensors) for r in loaded)


def test_the_output_rank_marks_the_reference_stage_itself(two_paths):
    """No gate task marks the reference stage: the rank that writes ref_logp does (its own task,
    train.reference_pass=separate; with fused, as here, publish marks it from that rank's train
    result), so the mark holds that one rank's measurements (a gate after both ranks' tasks stored
    two), before train's mark."""
    loop_dir, *_ = two_paths
    from storage.rollouts import RolloutStore

    store = RolloutStore(loop_dir / "rollouts.zarr")
    for step in range(ITERATIONS):
        attrs = store.attrs(step)
        marks = attrs["complete"]
        assert set(marks) == {"rollout", "reward", "reference", "advantage", "train", "publish", "lineage"}
        assert marks.index("reference") < marks.index("train")
        (only,) = attrs["results_reference"]
        assert only["reference_seconds"] > 0


def test_colocated_engines_receive_beside_their_training_rank(tmp_path):
    """cluster.placement=colocated: the engine's receiving thread runs in training worker 0's
    process, beside pipeline rank 0's sender; versions still arrive in memory."""
    cfg = load_config("configs/tiny.yaml", [
        "iterations=2", "run_name=colocated", f"runs_dir={tmp_path}", "warmup.steps=30", "task.prompts_per_step=8",
        "train.micro_batch_size=16", "cluster.placement=colocated", "cluster.weight_sync=memory"])
    metrics = run(cfg, progress=False).metrics
    n = cfg.rollout.num_engines
    assert [(m["weight_loads_from_memory"], m["weight_loads_from_disk"]) for m in metrics] == [(0, n), (n, 0)]
    assert all(m["weight_sync_memory_send_failures"] == 0 for m in metrics)
