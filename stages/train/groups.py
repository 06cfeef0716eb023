"""Process groups of one training rank: the world, and its pp, dp and tp groups plus the group of
the two ranks holding a tied embedding, every one with the configured timeout.

Rendezvous: rank 0 hosts a TCPStore at ``init_method`` (tcp://host:port), listening on that address
only (stages/tcp_store.py); the world process group
uses it under a prefix and the engine keeps it to report failures (stages/train/faults.py).
Groups are created with ``dist.new_group(..., timeout=...)`` rather than ``init_device_mesh`` so
every collective and P2P wait is bounded by ``train.timeout_s``; the TP group becomes a 1-D
DeviceMesh for ``parallelize_module``.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta
from typing import Optional

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from stages.tcp_store import tcp_store
from stages.layout import MeshCoord, ParallelLayout

__all__ = ["RankGroups", "init_rank_groups"]


@dataclass
class RankGroups:
    """Live process groups of one rank (mutable: destroyed with the process group)."""

    layout: ParallelLayout
    rank: int
    coord: MeshCoord
    store: dist.Store
    pp: Optional[dist.ProcessGroup]
    dp: Optional[dist.ProcessGroup]
    tp: Optional[dist.ProcessGroup]
    tied: Optional[dist.ProcessGroup]  # None when one rank holds both copies, or nothing is tied
    tp_mesh: Optional[DeviceMesh]  # None without tensor parallelism
    owns_world: bool


def _store(init_method: str, rank: int, world_size: int, timeout: timedelta) -> dist.Store:
    return tcp_store(init_method, world_size, is_master=rank == 0, timeout=timeout)


def init_rank_groups(layout: ParallelLayout, rank: int, init_method: str, timeout: timedelta,
                     tied_weights: bool, device_type: str = "cpu") -> RankGroups:
    """Join (or reuse) the world process group and create this rank's pp / dp / tp / tied groups:
    gloo on the CPU; on CUDA gloo for host tensors and NCCL for device ones (every group the same)."""
    world = layout.world_size
    owns_world = not dist.is_initialized()
    if owns_world:
        store = _store(init_method, rank, world, timeout)
        backend = "gloo" if device_type == "cpu" else f"cpu:gloo,{device_type}:nccl"
        dist.init_process_group(backend, store=dist.PrefixStore("pg/", store), rank=rank, world_size=world,
                                timeout=timeout)
    else:
        store = dist.distributed_c10d._get_default_store()
    if dist.get_world_size() != world:
        raise ValueError(f"the process group has {dist.get_world_size()} ranks; the layout "
                         f"pp x dp x tp = {layout.pp} x {layout.dp} x {layout.tp} needs {world}")
    mine: dict[str, Optional[dist.ProcessGroup]] = {}
    # new_group is collective over the world: every rank creates every group, in the same order.
    for axis in ("pp", "dp", "tp"):
        for ranks in layout.axis_groups(axis):
            group = dist.new_group(ranks, timeout=timeout)
            if rank in ranks:
                mine[axis] = group
    mine["tied"] = None
    if tied_weights:
        for ranks in layout.tied_groups():
            group = dist.new_group(ranks, timeout=timeout)
            if rank in ranks:
                mine["tied"] = group
    tp_mesh = None
    if layout.tp > 1:
        tp_mesh = DeviceMesh.from_group(mine["tp"], device_type, mesh_dim_names=("tp",))
    return RankGroups(layout, rank, layout.coord(rank), store, mine["pp"], mine["dp"], mine["tp"],
                      mine["tied"], tp_mesh, owns_world)
