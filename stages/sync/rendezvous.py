"""Rendezvous of a weight-sync channel: its store, the signature exchange and its process groups.

Pipeline rank 0 hosts a TCPStore at ``init_method``, listening on that address only
(stages/tcp_store.py); every side posts its signature under ``join/<side>``, waits (bounded) for all
the others', and plans the sync from the same table (stages/sync/plan.py). The groups are built directly as ProcessGroupGloo / ProcessGroupNCCL objects
on a PrefixStore, not through ``init_process_group``: a training rank already belongs to the
training world and an engine to none, and such a group needs neither.
"""

from __future__ import annotations

import json
import logging
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from stages.sync.config import WeightSyncConfig, WeightSyncError
from stages.sync.plan import SyncPlan, TensorSpec, plan_sync
from stages.tcp_store import tcp_store

__all__ = ["resolve_backend", "open_store", "join", "new_group", "first_line"]

_STORE_PREFIX = "grpoflow-sync"
_POLL_S = 0.02  # rendezvous polling: a few round trips to the store per 100 ms

log = logging.getLogger(__name__)


def resolve_backend(cfg: WeightSyncConfig, device: torch.device) -> str:
    backend = cfg.backend if cfg.backend != "auto" else ("nccl" if device.type == "cuda" else "gloo")
    if backend == "nccl" and (device.type != "cuda" or not dist.is_nccl_available()):
        raise ValueError(f"sync.backend=nccl needs CUDA tensors and an NCCL build (tensors on {device}); "
                         "use gloo")
    return backend


def open_store(cfg: WeightSyncConfig, host: bool) -> dist.Store:
    try:
        store = tcp_store(cfg.init_method, cfg.num_sources + cfg.num_engines, is_master=host, timeout=cfg.timeout)
    except Exception as exc:
        raise WeightSyncError(f"weight sync channel {cfg.channel!r}: cannot reach the store at {cfg.init_method} "
                              f"within {cfg.timeout_s} s (pipeline rank 0 hosts it): {exc}") from exc
    return dist.PrefixStore(f"{_STORE_PREFIX}/{cfg.channel}/", store)


def _await_peers(store: dist.Store, cfg: WeightSyncConfig, me: str, sides: list[str]) -> None:
    """Wait until every side has posted its signature. The first side to time out posts the
    verdict under ``abort``: the others raise it at once, and the store's host (pipeline rank 0)
    stays until each side present has read it, so nobody finds the store gone instead. Polling
    rather than ``store.wait``: a timed-out wait does not say which key was late."""
    deadline = time.monotonic() + cfg.timeout_s
    missing = list(sides)
    while True:
        try:
            if store.check(["abort"]):
                message = store.get("abort").decode()
                _leave_after_abort(store, cfg, me, sides)
                raise WeightSyncError(message)
            missing = [w for w in missing if not store.check([f"join/{w}"])]
        except WeightSyncError:
            raise
        except Exception as exc:
            raise WeightSyncError(f"weight sync channel {cfg.channel!r}: the store went away while waiting for "
                                  f"{', '.join(missing)}: {first_line(exc)}") from exc
        if not missing:
            return
        if time.monotonic() > deadline:
            break
        time.sleep(_POLL_S)
    message = (f"weight sync channel {cfg.channel!r}: {', '.join(missing)} did not join within {cfg.timeout_s} s; "
               "start a sender on every pipeline rank (dp=tp=0) and a receiver on every engine, with the same "
               "sync config")
    store.set("abort", message)
    _leave_after_abort(store, cfg, me, sides)
    raise WeightSyncError(message)


def _leave_after_abort(store: dist.Store, cfg: WeightSyncConfig, me: str, sides: list[str]) -> None:
    """Mark the abort as seen here; the store's host first waits (bounded) for every side that
    joined to have seen it."""
    store.set(f"seen-abort/{me}", "1")
    if me != sides[0]:
        return
    deadline = time.monotonic() + cfg.timeout_s
    while time.monotonic() < deadline:
        joined = [w for w in sides if store.check([f"join/{w}"])]
        if all(store.check([f"seen-abort/{w}"]) for w in joined):
            return
        time.sleep(_POLL_S)


def join(cfg: WeightSyncConfig, store: dist.Store, me: str, specs: list[TensorSpec], backend: str) -> SyncPlan:
    """Post this side's signature, read everyone's, and plan (the same plan, or the same error, on
    every side)."""
    sources = [f"pp={p}" for p in range(cfg.num_sources)]
    engines = [f"engine {e}" for e in range(cfg.num_engines)]
    keys = [f"join/{who}" for who in sources + engines]
    store.set(f"join/{me}", json.dumps({"specs": specs, "backend": backend}))
    _await_peers(store, cfg, me, sources + engines)
    table = {k.removeprefix("join/"): json.loads(store.get(k)) for k in keys}
    # The store's host may leave as soon as it has planned (a mismatch ends every side): it first
    # waits, bounded, until every side has read the table too.
    store.set(f"read/{me}", "1")
    if me == sources[0]:
        try:
            store.wait([f"read/{who}" for who in sources + engines], cfg.timeout)
        except Exception:
            log.warning("weight sync channel %r: not every side read the signatures", cfg.channel)

    def specs_of(who: str) -> list[TensorSpec]:
        return [(n, tuple(shape), dtype) for n, shape, dtype in table[who]["specs"]]

    return plan_sync([specs_of(w) for w in sources], [specs_of(w) for w in engines], cfg.bucket_bytes,
                     {w: table[w]["backend"] for w in sources + engines})


def new_group(backend: str, store: dist.Store, rank: int, size: int, timeout: timedelta) -> dist.ProcessGroup:
    if backend == "gloo":
        return dist.ProcessGroupGloo(store, rank, size, timeout)
    opts = dist.ProcessGroupNCCL.Options()
    opts._timeout = timeout
    return dist.ProcessGroupNCCL(store, rank, size, opts)


def first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text.splitlines()[0] if text else 'no message'}"
