"""Dask cluster set-up: an embedded local cluster, or an existing scheduler.

Workers carry resources: ``train`` (one per training rank, pp x dp x tp of them), ``rollout``
(one per generation engine); plain workers take reward, advantage and IO tasks. A task asking for a
resource no worker has would wait forever in Dask, so :func:`check_pools` fails at start-up instead.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

import dask
from distributed import Client, Nanny, Scheduler, SpecCluster

from flows.schema import GRPOConfig

__all__ = ["ClusterError", "Pools", "start_cluster", "check_pools", "dashboard_link"]

log = logging.getLogger(__name__)


class ClusterError(RuntimeError):
    """The cluster lacks a worker pool the run needs."""


@dataclass(frozen=True)
class Pools:
    train: tuple[str, ...]  # worker addresses, index = global training rank (stages/train/layout.py)
    rollout: tuple[str, ...]
    plain: tuple[str, ...] = ()
    """Workers with neither resource: gates, reward, advantage and publish run there when there are
    any, so with several steps in flight they never queue behind a long train or rollout task."""

    @property
    def train_host(self) -> str:
        """Host of rank 0's worker: where the process-group rendezvous listens."""
        return self.train[0].split("://")[-1].rsplit(":", 1)[0]


def _worker(resources: dict[str, int]) -> dict:
    # One thread per worker process: torch ops inside use that process's own threads.
    return {"cls": Nanny, "options": {"nthreads": 1, "resources": resources, "memory_limit": 0}}


def start_cluster(cfg: GRPOConfig) -> tuple[Client, SpecCluster | None]:
    """A client on the configured scheduler, or on a new embedded cluster sized for ``cfg``."""
    if cfg.cluster.scheduler_address:
        client = Client(cfg.cluster.scheduler_address, timeout="30s")
        _announce_dashboard(client)
        return client, None
    workers: dict[str, dict] = {}
    for rank in range(cfg.train.world_size):
        res = {"train": 1}
        if cfg.cluster.colocated_pools and rank < cfg.rollout.num_engines:
            res["rollout"] = 1
        workers[f"train-{rank}"] = _worker(res)
    if not cfg.cluster.colocated_pools:
        for i in range(cfg.rollout.num_engines):
            workers[f"rollout-{i}"] = _worker({"rollout": 1})
    for i in range(cfg.cluster.num_plain_workers):
        workers[f"plain-{i}"] = _worker({})
    # Worker processes configure logging when they import distributed, from the environment.
    os.environ.setdefault("DASK_LOGGING__DISTRIBUTED", "warning")
    dask.config.set({"logging.distributed": "warning"})
    scheduler = {"cls": Scheduler, "options": {"dashboard_address": "127.0.0.1:0", "host": "127.0.0.1"}}
    for name in ("distributed.worker", "distributed.nanny", "distributed.scheduler", "distributed.core"):
        logging.getLogger(name).setLevel(logging.WARNING)
    cluster = SpecCluster(workers=workers, scheduler=scheduler, silence_logs=logging.WARNING,
                          name="grpoflow")
    client = Client(cluster)
    _announce_dashboard(client)
    return client, cluster


def dashboard_link(client: Client) -> str | None:
    """The Dask dashboard's URL, or None when the scheduler serves none (bokeh missing)."""
    try:
        services = client.scheduler_info(n_workers=0).get("services", {})
    except Exception:  # a scheduler that cannot answer has no dashboard to show
        return None
    return client.dashboard_link if "dashboard" in services else None


def _announce_dashboard(client: Client) -> None:
    link = dashboard_link(client)
    if link:
        log.info("Dask dashboard: %s", link)
    else:
        log.info("Dask dashboard: none (the scheduler serves none; install bokeh>=3.1 for it)")


def check_pools(client: Client, cfg: GRPOConfig, wait_s: float = 60.0) -> Pools:
    """The train and rollout workers, or a :class:`ClusterError` naming the missing resource."""
    t = cfg.train
    world = t.world_size
    try:
        client.wait_for_workers(1, timeout=wait_s)
    except TimeoutError as exc:
        raise ClusterError(f"no Dask worker joined within {wait_s:.0f} s") from exc
    workers = client.scheduler_info(n_workers=-1)["workers"]

    def having(resource: str) -> list[str]:
        return sorted((a for a, w in workers.items() if w.get("resources", {}).get(resource, 0) >= 1),
                      key=lambda a: (workers[a].get("name", ""), a))

    train, rollout = having("train"), having("rollout")
    if len(train) < world:
        raise ClusterError(
            f"train.pipeline_model_parallel_size x data_parallel_size x tensor_model_parallel_size = "
            f"{t.pipeline_model_parallel_size} x {t.data_parallel_size} x {t.tensor_model_parallel_size} = {world} "
            f"training ranks need {world} workers with the 'train' resource, the cluster has {len(train)}: "
            "start workers with --resources train=1")
    if not rollout:
        raise ClusterError("no worker offers the 'rollout' resource: start one with --resources rollout=1")
    plain = sorted(a for a, w in workers.items() if not {"train", "rollout"} & set(w.get("resources", {})))
    return Pools(tuple(train[:world]), tuple(rollout[: cfg.rollout.num_engines]), tuple(plain))
