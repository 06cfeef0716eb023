"""The cluster a CPU run's plan models: this host's cores shared by the run's ranks, at measured rates.

A run config with ``train.device: cpu`` and no ``plan.cluster`` section is planned on the machine
it would run on, not on the GPUs of ClusterConfig's defaults (which describe H100s):

- ``peak_flops``: the host's matmul rate in the training dtype with every core (the rate a step's
  MFU is taken against, cached in ``<runs_dir>/_cache/host_rates.json``), split evenly over the
  run's ranks, which share the cores;
- ``mfu``: :data:`CPU_STEP_MFU`, the share of that rate the runtime's training step reaches on a
  real model (docs/performance.md: 37-40% on SmolLM2-135M);
- memory: the host's RAM split over the ranks; ``hbm_bandwidth_bytes_per_s`` and
  ``host_bandwidth_bytes_per_s``: a measured copy bandwidth of host memory, split the same way;
- links between ranks: gloo over loopback (:data:`LOOPBACK_BANDWIDTH`, :data:`LOOPBACK_LATENCY_S`).

The plan's memory figures hold as on a GPU; its times are first-order: the planner's decode model is
bandwidth-bound, and a small model's CPU decode is bound by per-token work the model does not count.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

__all__ = ["CPU_STEP_MFU", "LOOPBACK_BANDWIDTH", "LOOPBACK_LATENCY_S", "host_cluster"]

CPU_STEP_MFU = 0.4
"""Share of the measured matmul rate a training step reaches on this runtime (SmolLM2: 37-40%)."""
LOOPBACK_BANDWIDTH = 1e9
"""Bytes/s of gloo's send/recv between two processes of one host, order of magnitude."""
LOOPBACK_LATENCY_S = 100e-6
"""Fixed cost of one gloo message over loopback, order of magnitude."""


def _host_memory_bytes() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def _copy_bandwidth(nbytes: int = 64 << 20, reps: int = 5) -> float:
    """Bytes/s of a large tensor copy (read + write counted), the fastest of ``reps``."""
    import torch

    src = torch.empty(nbytes // 4, dtype=torch.float32).fill_(1.0)
    dst = torch.empty_like(src)
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - t0)
    return 2 * nbytes / best


def host_cluster(world_size: int, dtype: str, runs_dir: str | Path) -> dict[str, Any]:
    """plan.cluster's fields for ``world_size`` ranks of a CPU run on this host, training in ``dtype``."""
    from storage.host_rates import HOST_RATES_FILE, host_cores, matmul_rate

    rate = matmul_rate(Path(runs_dir) / "_cache" / HOST_RATES_FILE, dtype, "cpu", host_cores())
    copy = _copy_bandwidth()
    return dict(device="cpu", num_gpus=world_size, gpus_per_node=world_size,
                gpu_memory_bytes=_host_memory_bytes() // world_size, peak_flops=rate / world_size,
                mfu=CPU_STEP_MFU, hbm_bandwidth_bytes_per_s=copy / world_size, hbm_efficiency=1.0,
                host_bandwidth_bytes_per_s=copy / world_size, intra_node_bandwidth_bytes_per_s=LOOPBACK_BANDWIDTH,
                inter_node_bandwidth_bytes_per_s=LOOPBACK_BANDWIDTH, collective_latency_s=LOOPBACK_LATENCY_S)
