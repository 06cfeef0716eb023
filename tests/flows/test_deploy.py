"""flows/deploy.py: the worker commands, Slurm script and Kubernetes manifests a config asks for
hold its workers with their resources (tests/flows/test_hosts.py starts a real cluster from
worker_command)."""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
from collections import Counter

import yaml

from flows.cluster import worker_resources
from flows.config import load_config
from flows.deploy import TLSFiles, kubernetes_manifests, shell_script, slurm_script

TLS = TLSFiles(ca="/etc/grpoflow/ca.pem", cert="/etc/grpoflow/w.pem", key="/etc/grpoflow/w.key")


def _resources_of(args: list[str]) -> dict[str, int]:
    if "--resources" not in args:
        return {}
    return {k: int(v) for k, v in (kv.split("=") for kv in args[args.index("--resources") + 1].split(","))}


def test_worker_resources_follow_the_layout():
    tiny = load_config("configs/tiny.yaml", [])
    assert worker_resources(tiny) == {"train-0": {"train": 1, "rollout": 1}, "train-1": {"train": 1, "rollout": 1},
                                      "plain-0": {}}
    decoupled = load_config("configs/tiny.yaml", ["cluster.placement=decoupled", "rollout.num_engines=1",
                                                  "eval.path=data/arithmetic_test.jsonl"])
    assert worker_resources(decoupled) == {"train-0": {"train": 1}, "train-1": {"train": 1}, "rollout-0": {"rollout": 1},
                                           "plain-0": {}, "eval-0": {"eval": 1}}


def test_shell_and_slurm_scripts_start_every_worker():
    cfg = load_config("configs/tiny.yaml", ["eval.path=data/arithmetic_test.jsonl"])
    workers = worker_resources(cfg)
    for script in (shell_script(cfg, "tls://head:8786", TLS), slurm_script(cfg, "tls://head:8786", TLS, partition="cpu")):
        assert subprocess.run(["bash", "-n"], input=script, text=True).returncode == 0
        lines = [shlex.split(line.rstrip(" &")) for line in script.splitlines() if " worker tls://head:8786 " in line]
        started = {args[args.index("--name") + 1]: _resources_of(args) for args in lines}
        assert started == workers
        assert all(args[args.index("--tls-ca-file") + 1] == TLS.ca for args in lines)
    slurm = slurm_script(cfg, "tls://head:8786", partition="cpu")
    assert re.search(rf"^#SBATCH --ntasks={len(workers)}$", slurm, re.M) and "#SBATCH --partition=cpu" in slurm
    assert "--tls-" not in slurm  # no TLS files given: none named


def test_kubernetes_manifests_hold_the_workers_by_resources():
    cfg = load_config("configs/tiny.yaml", ["eval.path=data/arithmetic_test.jsonl"])
    docs = list(yaml.safe_load_all(kubernetes_manifests(cfg, "registry.example/grpoflow:1")))
    assert [d["kind"] for d in docs] == ["DaskCluster"] + ["DaskWorkerGroup"] * (len(docs) - 1)
    name = docs[0]["metadata"]["name"]
    assert all(d["spec"]["cluster"] == name for d in docs[1:])
    found: Counter[tuple] = Counter()
    for doc in docs:
        worker = doc["spec"]["worker"]
        (container,) = worker["spec"]["containers"]
        assert container["image"] == "registry.example/grpoflow:1"
        assert {"name": "runs", "mountPath": "/runs"} in container["volumeMounts"]
        found[tuple(sorted(_resources_of(container["args"]).items()))] += worker["replicas"]
    assert found == Counter(tuple(sorted(r.items())) for r in worker_resources(cfg).values())
    assert docs[0]["spec"]["scheduler"]["service"]["ports"][0]["port"] == 8786


def test_cli_prints_workers_and_refuses_in_one_line():
    cli = [sys.executable, "-m", "flows.cli", "workers", "configs/tiny.yaml"]
    ok = subprocess.run([*cli, "--scheduler", "tcp://head:8786"], capture_output=True, text=True, timeout=120)
    assert ok.returncode == 0 and ok.stdout.count("dask worker tcp://head:8786 ") == 3, ok.stderr
    for extra, word in ((["--format", "kubernetes"], "--image"), ([], "--scheduler"),
                        (["--scheduler", "tcp://h:1", "--tls-cert", "c.pem"], "--tls-ca-file")):
        bad = subprocess.run([*cli, *extra], capture_output=True, text=True, timeout=120)
        assert bad.returncode == 2 and len(bad.stderr.strip().splitlines()) == 1 and word in bad.stderr, bad.stderr
