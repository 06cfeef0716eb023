"""What a hop between dependent tasks costs on the embedded cluster, with nothing else running.

A step of the tiny config is three hops long besides its tasks (benchmarks/critical_path.py):
the training ranks' tasks -> publish (a plain worker) -> the rollout tasks (on the training
workers, colocated) -> the training ranks' tasks. This starts the tiny config's embedded cluster
(flows/cluster.py, the same workers and settings as ``grpoflow run``), submits ``--steps`` rings of
empty tasks shaped like that graph (two per training stage, one on each training worker; one
publish on the plain worker, waiting on both), and prints the median of each hop: the dependent
task's start minus the end of the last task it waited on, both timed inside the tasks. It is the
floor of the hops a step's window pays when its tasks do work (docs/performance.md).

    PYTHONPATH=$PWD .venv/bin/python benchmarks/dask_hop.py --steps 40
    PYTHONPATH=$PWD .venv/bin/python benchmarks/dask_hop.py --steps 40 --set distributed.scheduler.work-stealing=false
    PYTHONPATH=$PWD .venv/bin/python benchmarks/dask_hop.py --steps 40 --unbatched

``--unbatched``: the scheduler's and the workers' messages go at once instead of being batched
over distributed's fixed intervals (5 ms from the scheduler, 2 ms from a worker; no config key),
by two plugins that set those streams' ``interval`` to 0 (docs/performance.md, "The hops' floor").
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import yaml
from distributed import SchedulerPlugin, WorkerPlugin

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from flows.cluster import CLUSTER_TIMERS, check_pools, start_cluster, worker_addresses  # noqa: E402
from flows.config import load_config  # noqa: E402

_HOPS = ("train -> publish", "publish -> rollout", "rollout -> train")


def _task(*deps: tuple[float, float]) -> tuple[float, float]:
    """(start, end) of an empty task; ``deps``: the (start, end) of the tasks it waited on."""
    t = time.time()
    return t, time.time()


class _UnbatchedScheduler(SchedulerPlugin):
    """The scheduler's streams to the workers, those it holds and those of workers joining later,
    send each message at once."""

    name = "dask-hop-unbatched-scheduler"

    async def start(self, scheduler) -> None:
        for stream in scheduler.stream_comms.values():
            stream.interval = 0.0

    def add_worker(self, scheduler, worker: str) -> None:
        scheduler.stream_comms[worker].interval = 0.0


class _UnbatchedWorker(WorkerPlugin):
    """A worker's stream to the scheduler sends each message at once."""

    name = "dask-hop-unbatched-worker"

    def setup(self, worker) -> None:
        worker.batched_stream.interval = 0.0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--skip", type=int, default=3, help="first rings left out (warm-up)")
    parser.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE",
                        help="Dask config settings for the cluster's servers, on top of flows/cluster.py's")
    parser.add_argument("--unbatched", action="store_true",
                        help="the scheduler's and workers' messages sent at once (module docstring)")
    args = parser.parse_args()
    if args.steps <= args.skip + 1:
        parser.error(f"--steps {args.steps} leaves no ring to measure after --skip {args.skip}")
    cfg = load_config("configs/tiny.yaml", [])
    settings = dict(CLUSTER_TIMERS)
    for item in args.set:
        key, sep, value = item.partition("=")
        if not sep:
            parser.error(f"--set {item!r} is not KEY=VALUE")
        settings[key] = yaml.safe_load(value)
    client, cluster = start_cluster(cfg, settings)
    try:
        if args.unbatched:
            client.register_plugin(_UnbatchedScheduler())
            client.register_plugin(_UnbatchedWorker())
        pools = check_pools(client, cfg)
        where = worker_addresses(client)
        train = [where[name] for name in pools.train]
        plain = [where[name] for name in pools.plain] or train[:1]
        client.gather([client.submit(_task, workers=[w], pure=False) for w in train + plain])  # every worker up
        on = lambda w: dict(workers=[w], pure=False)  # noqa: E731
        trains = [client.submit(_task, **on(w)) for w in train]
        rings = []
        for _ in range(args.steps):
            publish = client.submit(_task, *trains, **on(plain[0]))
            rollouts = [client.submit(_task, publish, **on(w)) for w in train]
            trains = [client.submit(_task, *rollouts, **on(w)) for w in train]
            rings.append((publish, rollouts, trains))
        prev_end = None
        hops: dict[str, list[float]] = {h: [] for h in _HOPS}
        for i, (publish, rollouts, trains_) in enumerate(rings):
            p = publish.result()
            r = client.gather(rollouts)
            t = client.gather(trains_)
            if prev_end is not None and i >= args.skip:
                hops["train -> publish"].append(p[0] - prev_end)
                hops["publish -> rollout"].append(min(s for s, _ in r) - p[1])
                hops["rollout -> train"].append(min(s for s, _ in t) - max(e for _, e in r))
            prev_end = max(e for _, e in t)
    finally:
        client.close()
        if cluster is not None:
            cluster.close()
    print(f"empty tasks, {args.steps - args.skip} rings of the tiny config's graph on its embedded cluster "
          f"({len(train)} training workers, {len(plain)} plain){', unbatched' if args.unbatched else ''}:")
    for h in _HOPS:
        v = hops[h]
        print(f"  {h}: median {1e3 * statistics.median(v):.1f} ms (min {1e3 * min(v):.1f}, max {1e3 * max(v):.1f})")
    total = sum(statistics.median(hops[h]) for h in _HOPS)
    print(f"  three hops: {1e3 * total:.1f} ms a step")


if __name__ == "__main__":
    main()
