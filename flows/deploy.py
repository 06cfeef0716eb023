"""The Dask workers a run of a config asks for, written out for a cluster of one's own
(``cluster.scheduler_address``): ``dask worker`` command lines, a Slurm batch script, or
manifests for the Dask Kubernetes operator. ``grpoflow workers CONFIG --format ...`` prints them;
docs/scaling.md walks through each. The workers are the ones the embedded cluster starts
(flows/cluster.py ``worker_resources``): one per training rank, per decoupled rollout engine, per
plain worker, and the eval worker.

Every worker needs the project installed, the run folder's file system at the same path as the
driver (runs_dir: policy versions, Zarr steps and the MLflow store are files), and one thread
(torch's own threads run inside it). Over TLS each gets the certificate files.
"""

from __future__ import annotations

import shlex
from collections import Counter
from dataclasses import dataclass
from typing import Optional

import yaml

from flows.cluster import worker_resources
from flows.config import GRPOConfig

__all__ = ["FORMATS", "TLSFiles", "worker_command", "shell_script", "slurm_script", "kubernetes_manifests"]

FORMATS = ("shell", "slurm", "kubernetes")


@dataclass(frozen=True, slots=True, kw_only=True)
class TLSFiles:
    """PEM files of the cluster's certificate authority and of this process's certificate and key."""

    ca: str
    cert: str
    key: str

    def args(self) -> list[str]:
        return ["--tls-ca-file", self.ca, "--tls-cert", self.cert, "--tls-key", self.key]


def _resources_arg(resources: dict[str, int]) -> list[str]:
    return ["--resources", ",".join(f"{k}={v}" for k, v in sorted(resources.items()))] if resources else []


def worker_command(name: Optional[str], resources: dict[str, int], scheduler: str,
                   tls: Optional[TLSFiles] = None, host: Optional[str] = None) -> list[str]:
    """``dask worker`` joining ``scheduler`` as ``name`` with ``resources``, one thread, no memory
    limit (a training rank's peak is the planner's to judge, not the nanny's to kill), listening on
    ``host`` (an address of this machine the others reach; unset: Dask picks one)."""
    return ["dask", "worker", scheduler, *(["--name", name] if name else []), "--nthreads", "1",
            "--memory-limit", "0", *(["--host", host] if host else []), *_resources_arg(resources),
            *(tls.args() if tls else [])]


def _groups(cfg: GRPOConfig) -> list[tuple[str, dict[str, int], int]]:
    """(group name, resources, how many) of the config's workers, in the embedded cluster's order."""
    counts: Counter[tuple[tuple[str, int], ...]] = Counter()
    for res in worker_resources(cfg).values():
        counts[tuple(sorted(res.items()))] += 1
    return [("-".join(k for k, _ in key) or "plain", dict(key), n) for key, n in counts.items()]


def shell_script(cfg: GRPOConfig, scheduler: str, tls: Optional[TLSFiles] = None) -> str:
    """One ``dask worker`` line per worker, each in the background, for the hosts to split among them."""
    lines = [f"# the workers of run {cfg.run_name}: run each line on the host it should live on",
             "# (GLOO_SOCKET_IFNAME=<interface> where the host's name resolves to another interface than the hosts share)"]
    lines += [shlex.join(worker_command(name, res, scheduler, tls)) + " &" for name, res in worker_resources(cfg).items()]
    return "\n".join([*lines, "wait", ""])


def slurm_script(cfg: GRPOConfig, scheduler: str, tls: Optional[TLSFiles] = None, *, cpus_per_worker: int = 4,
                 time_limit: str = "12:00:00", partition: Optional[str] = None) -> str:
    """An sbatch script whose job runs every worker as one task (srun), a training rank per task."""
    workers = worker_resources(cfg)
    lines = ["#!/bin/bash", f"#SBATCH --job-name=grpoflow-{cfg.run_name}-workers", f"#SBATCH --ntasks={len(workers)}",
             f"#SBATCH --cpus-per-task={cpus_per_worker}", f"#SBATCH --time={time_limit}"]
    if partition:
        lines.append(f"#SBATCH --partition={partition}")
    lines += ["# the scheduler and the driver run elsewhere: dask scheduler ..., then",
              f"#   grpoflow run CONFIG cluster.scheduler_address={scheduler}", "set -euo pipefail"]
    for name, res in workers.items():
        lines.append(f"srun --ntasks=1 --nodes=1 --exclusive --cpus-per-task={cpus_per_worker} "
                     + shlex.join(worker_command(name, res, scheduler, tls)) + " &")
    return "\n".join([*lines, "wait", ""])


def kubernetes_manifests(cfg: GRPOConfig, image: str, *, runs_claim: str = "grpoflow-runs",
                         runs_mount: str = "/runs") -> str:
    """A DaskCluster (the scheduler, and the first group of workers) and a DaskWorkerGroup per
    further group of workers with the same resources, for the Dask Kubernetes operator
    (kubernetes.dask.org/v1). Every container mounts the PersistentVolumeClaim ``runs_claim`` at
    ``runs_mount``: run the driver with runs_dir there and
    cluster.scheduler_address=tcp://<cluster name>-scheduler:8786."""
    cluster = f"grpoflow-{cfg.run_name}".lower().replace("_", "-")
    volume = {"name": "runs", "persistentVolumeClaim": {"claimName": runs_claim}}
    mount = {"name": "runs", "mountPath": runs_mount}

    def worker(resources: dict[str, int], replicas: int) -> dict:
        args = ["dask", "worker", "--name", "$(DASK_WORKER_NAME)", "--nthreads", "1", "--memory-limit", "0",
                "--dashboard", "--dashboard-address", "8788", *_resources_arg(resources)]
        return {"replicas": replicas, "spec": {
            "containers": [{"name": "worker", "image": image, "args": args, "volumeMounts": [mount],
                            "ports": [{"name": "http-dashboard", "containerPort": 8788, "protocol": "TCP"}]}],
            "volumes": [volume]}}

    groups = _groups(cfg)
    scheduler_ports = [{"name": "tcp-comm", "containerPort": 8786, "protocol": "TCP"},
                       {"name": "http-dashboard", "containerPort": 8787, "protocol": "TCP"}]
    docs = [{"apiVersion": "kubernetes.dask.org/v1", "kind": "DaskCluster", "metadata": {"name": cluster},
             "spec": {"worker": worker(groups[0][1], groups[0][2]),
                      "scheduler": {
                          "spec": {"containers": [{"name": "scheduler", "image": image, "args": ["dask", "scheduler"],
                                                   "ports": scheduler_ports}]},
                          "service": {"type": "ClusterIP",
                                      "selector": {"dask.org/cluster-name": cluster, "dask.org/component": "scheduler"},
                                      "ports": [{"name": "tcp-comm", "protocol": "TCP", "port": 8786,
                                                 "targetPort": "tcp-comm"},
                                                {"name": "http-dashboard", "protocol": "TCP", "port": 8787,
                                                 "targetPort": "http-dashboard"}]}}}}]
    for name, resources, replicas in groups[1:]:
        docs.append({"apiVersion": "kubernetes.dask.org/v1", "kind": "DaskWorkerGroup",
                     "metadata": {"name": f"{cluster}-{name}"},
                     "spec": {"cluster": cluster, "worker": worker(resources, replicas)}})
    header = (f"# the workers of run {cfg.run_name} ({groups[0][0]} in the DaskCluster, then one DaskWorkerGroup per "
              f"further kind); kubectl apply -f this file\n")
    return header + yaml.safe_dump_all(docs, sort_keys=False)
