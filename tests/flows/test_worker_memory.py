"""The embedded cluster's workers keep freed buffers in the heap (flows/cluster.py
WORKER_MALLOC_ENV): a training step's buffers are reused, not faulted in afresh each time; and
they run without Dask's sampling profiler unless cluster.worker_profiler asks for it; and every
server of the cluster keeps to flows/cluster.py CLUSTER_TIMERS (its idle periodic work)."""

from __future__ import annotations

import os
import resource

import numpy as np

from dask.utils import parse_timedelta

from flows.cluster import CLUSTER_TIMERS, WORKER_MALLOC_ENV, start_cluster
from flows.config import load_config


def _faults_of_reused_buffers(count: int = 50, nbytes: int = 4 << 20) -> int:
    """Minor page faults of this thread over ``count`` allocate-touch-free cycles of a 4 MiB buffer."""
    before = resource.getrusage(resource.RUSAGE_THREAD).ru_minflt
    for _ in range(count):
        buf = np.empty(nbytes, np.uint8)
        buf[::4096] = 1  # touch every page
        del buf
    return resource.getrusage(resource.RUSAGE_THREAD).ru_minflt - before


def test_workers_reuse_freed_buffers(tmp_path):
    cfg = load_config("configs/tiny.yaml", [f"runs_dir={tmp_path}", "cluster.num_plain_workers=0"])
    client, cluster = start_cluster(cfg)
    try:
        envs = client.run(lambda: {k: os.environ.get(k) for k in WORKER_MALLOC_ENV})
        assert envs and all(env == WORKER_MALLOC_ENV for env in envs.values()), envs
        faults = client.run(_faults_of_reused_buffers)
        profiling = client.run(lambda dask_worker: "profile" in dask_worker.periodic_callbacks)
        assert not any(profiling.values()), profiling  # cluster.worker_profiler=false (the default)
        # The tick and system-monitor callbacks of the scheduler, the nannies and the workers (ms).
        want = {name: parse_timedelta(CLUSTER_TIMERS[f"distributed.admin.{key}.interval"], "ms") * 1000
                for name, key in (("tick", "tick"), ("monitor", "system-monitor"))}

        def timers(server) -> dict[str, float]:
            return {n: server.periodic_callbacks[n].callback_time for n in want if n in server.periodic_callbacks}
        servers = [*client.run(lambda dask_worker: timers(dask_worker)).values(),
                   *client.run(lambda dask_worker: timers(dask_worker), nanny=True).values(),
                   client.run_on_scheduler(lambda dask_scheduler: timers(dask_scheduler))]
        assert all(t.get("tick") == want["tick"] for t in servers), (servers, want)
        assert any("monitor" in t for t in servers) and all(t.get("monitor", want["monitor"]) == want["monitor"]
                                                             for t in servers), (servers, want)
        # With Dask's default (a 64 KiB trim threshold, so a 128 KiB mmap threshold) each cycle maps
        # the buffer afresh: ~25.6k faults over the 50 cycles here. Reused heap memory faults ~500.
        assert all(f < 5 * 1024 for f in faults.values()), faults
    finally:
        client.close()
        cluster.close()
