"""CPU an idle embedded cluster costs: Dask's own timers against flows/cluster.py CLUSTER_TIMERS.

Starts the tiny config's embedded cluster (scheduler and nannies in this process, four worker
processes) with Dask's default event-loop tick (20 ms) and system monitor (500 ms), with the
project's tick alone, and with both of the project's settings, alternating ``--rounds`` times; each time it waits for the workers to settle and
then measures the CPU seconds of this process and of every worker over ``--seconds`` with no task
running. Prints the medians as percent of one core.

    PYTHONPATH=$PWD .venv/bin/python benchmarks/cluster_idle.py --rounds 2 --seconds 10
"""

from __future__ import annotations

import argparse
import statistics
import time

import psutil

from flows.cluster import CLUSTER_TIMERS, start_cluster
from flows.config import load_config

_SETTLE_S = 3.0  # workers import torch and join; their start-up is not idle time


def _idle_percent(timers: dict[str, str], seconds: float) -> tuple[float, float]:
    """(this process, all workers) CPU percent of one core while the cluster idles."""
    client, cluster = start_cluster(load_config("configs/tiny.yaml", []), timers)
    try:
        time.sleep(_SETTLE_S)
        me = psutil.Process()
        procs = [me, *me.children(recursive=True)]

        def cpu() -> dict[int, float]:
            return {p.pid: sum(p.cpu_times()[:2]) for p in procs}

        before, t0 = cpu(), time.perf_counter()
        time.sleep(seconds)
        after, wall = cpu(), time.perf_counter() - t0
        used = {pid: after[pid] - before[pid] for pid in after}
        return 100 * used.pop(me.pid) / wall, 100 * sum(used.values()) / wall
    finally:
        client.close()
        cluster.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--seconds", type=float, default=10.0)
    args = parser.parse_args()
    tick = "distributed.admin.tick.interval"
    variants = {"Dask defaults": {}, f"tick {CLUSTER_TIMERS[tick]} only": {tick: CLUSTER_TIMERS[tick]},
                "CLUSTER_TIMERS": CLUSTER_TIMERS}
    runs: dict[str, list[tuple[float, float]]] = {name: [] for name in variants}
    for _ in range(args.rounds):
        for name, timers in variants.items():
            runs[name].append(_idle_percent(timers, args.seconds))
    print("| timers | driver (% of a core) | workers, all four | total |\n| --- | --- | --- | --- |")
    for name, rows in runs.items():
        driver = statistics.median(r[0] for r in rows)
        workers = statistics.median(r[1] for r in rows)
        print(f"| {name} | {driver:.1f} | {workers:.1f} | {driver + workers:.1f} |")


if __name__ == "__main__":
    main()
