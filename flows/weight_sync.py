"""Weight sync in the flow: how a new policy version reaches the rollout engines.

cluster.weight_sync = disk: the engine loads each version from its published folder. memory: in
addition to the folder (which stays the lineage and the resume point), every pipeline rank
(dp = tp = 0) broadcasts its shard of the new version to the engines right after the optimiser
step (stages/sync/channel.py), and the engine takes the weights it received: the version is the
one in the sync's header, and the rollout task still refuses a step whose version differs.

The channel is opened whenever the training ranks are built (start, resume, ranks rebuilt after a
lost worker) from version t: every engine worker starts a receiving thread
(stages/sync/stream.py), every training rank joins, and each later version t + 1, t + 2 ... is
announced and sent. A version the engine did not receive on its channel (t itself and older
ones, a version whose send failed, an engine process that replaced a lost one) is loaded from
disk: publication finishes only after the send, and a step asking for a version is submitted only
after it is published, so an engine never waits for a version that is not on its way. Every wait
is bounded by cluster.weight_sync_timeout_s; a send that fails (an engine died) leaves that
version and the rest of the channel's to disk, and the channel is opened again before the next
step once no step is in flight and every engine is back. Colocated placement uses the same
channel: the engine's receiving thread runs in a training worker's process, beside its sender.

The endpoints live in the worker's state (flows/worker.py), keyed by run; the driver's record of
the engines each run's channel was opened with lives here.
"""

from __future__ import annotations

import itertools
import logging
import time
from typing import Sequence

from distributed import Client, wait

from flows.cluster import ClusterError, Pools, worker_addresses
from flows.config import GRPOConfig
from flows.results import RolloutResult, TrainResult
from flows.worker import set_threads
from flows.worker import state as worker_state
from stages.policy import DecoderConfig, build_stage, hf_state
from stages.sync import SignatureMismatchError, WeightReceiver, WeightSender, WeightSyncConfig, WeightSyncError
from stages.sync.plan import tensor_specs
from stages.sync.stream import VersionStream
from stages.tcp_store import free_port
from storage.model_folder import load_hf_config
from storage.policies import PolicyRef

__all__ = ["engines_moved", "open_channel", "reopen_if_engines_moved", "close_channel", "connect_sender", "send_version",
           "start_receiver", "close_endpoints", "step_metrics"]

log = logging.getLogger(__name__)

# Driver: run -> engine name -> address of the engines its channel was last opened with.
_OPEN: dict[str, dict[str, str]] = {}
_COUNTER = itertools.count()


# -- the driver -----------------------------------------------------------------------------------------
def open_channel(client: Client, cfg: GRPOConfig, pools: Pools, policy: PolicyRef) -> None:
    """Open a new channel between the training ranks (built from ``policy``) and the engines; with
    cluster.weight_sync = disk, nothing. Call it when no task runs on the training workers.
    Raises a SignatureMismatchError when the two sides describe different models; any other
    failure to connect leaves the run on disk until the next opening, with a warning."""
    if cfg.cluster.weight_sync != "memory":
        return
    c = cfg.cluster
    train0 = pools.train_addresses[0]
    port = client.submit(free_port, pools.train_host, workers=[train0], pure=False).result(timeout=c.worker_wait_s)
    now = worker_addresses(client)
    engines = {name: now[name] for name in pools.rollout if name in now}
    if len(engines) < len(pools.rollout):
        log.warning("weight sync: engine %s is not up; versions load from disk until the channel reopens",
                    ", ".join(n for n in pools.rollout if n not in now))
        _OPEN[cfg.run_name] = engines
        return
    sync = WeightSyncConfig(f"tcp://{pools.train_host}:{port}", num_sources=cfg.train.pipeline_model_parallel_size,
                            num_engines=len(engines), timeout_s=c.weight_sync_timeout_s,
                            content_hash=c.weight_sync_content_hash,
                            channel=f"{cfg.run_name}-{port}-{next(_COUNTER)}")
    keep = cfg.rollout.max_staleness + 2  # versions ahead of the one in use: at most s + 1 in flight
    _OPEN[cfg.run_name] = engines
    try:
        for i, address in enumerate(engines.values()):
            client.run(start_receiver, cfg.run_name, sync, i, policy.path, keep, workers=[address])
    except Exception as exc:  # an engine died just now
        log.warning("weight sync: an engine did not start its receiver (%s); versions load from disk until the "
                    "channel reopens", exc)
        close_channel(client, cfg)
        return
    futures = [client.submit(connect_sender, cfg, sync, workers=[w], resources={"train": 1}, pure=False,
                             key=f"weight-sync-connect-{r}-{sync.channel}")
               for r, w in enumerate(pools.train_addresses)]
    limit_s = 3 * sync.timeout_s + c.worker_wait_s  # store, signatures and groups, each bounded
    try:
        wait(futures, timeout=limit_s)
    except TimeoutError as exc:
        for f in futures:
            f.cancel()
        raise ClusterError(f"weight sync: the training ranks did not join channel {sync.channel} within "
                           f"{limit_s:.0f} s") from exc
    errors = [f.result() for f in futures if f.result()]
    if errors:  # no half-open channel: every side closes, the run goes on by disk
        close_channel(client, cfg)
    mismatch = next((e for e in errors if e.startswith(SignatureMismatchError.__name__)), None)
    if mismatch:
        raise SignatureMismatchError(mismatch.split(": ", 1)[1])
    if errors:
        log.warning("weight sync: channel %s did not open (%s); versions load from disk until it reopens",
                    sync.channel, errors[0])


def engines_moved(client: Client, cfg: GRPOConfig, pools: Pools) -> bool:
    """Whether the run's channel is open and an engine worker was replaced (a new process at a new
    address) since it opened, every engine being up now (one scheduler round trip, memory sync only)."""
    if cfg.cluster.weight_sync != "memory" or cfg.run_name not in _OPEN:
        return False
    engines = _OPEN[cfg.run_name]
    now = worker_addresses(client)
    return all(n in now for n in pools.rollout) and any(engines.get(n) != now[n] for n in pools.rollout)


def reopen_if_engines_moved(client: Client, cfg: GRPOConfig, pools: Pools, policy: PolicyRef) -> None:
    """Open the channel again when :func:`engines_moved`. Call it only when no step is in flight."""
    if engines_moved(client, cfg, pools):
        engines, now = _OPEN[cfg.run_name], worker_addresses(client)
        log.warning("weight sync: engine worker(s) %s changed; reopening the channel",
                    ", ".join(n for n in pools.rollout if engines.get(n) != now[n]))
        open_channel(client, cfg, pools, policy)


def close_channel(client: Client, cfg: GRPOConfig) -> None:
    """Close the run's channel on every worker; the engines it was opened with are kept, so a
    replaced engine still reopens it (:func:`reopen_if_engines_moved`)."""
    try:
        client.run(close_endpoints, cfg.run_name)
    except Exception as exc:  # a worker that is gone holds no endpoint
        log.debug("closing the weight sync channel: %s", exc)


def step_metrics(rollouts: Sequence[RolloutResult], trains: Sequence[TrainResult]) -> dict[str, float]:
    """The step's weight-sync metrics from its tasks' results. Train (this step sends version
    step + 1): seconds and bytes of the in-memory send. Rollout (the version this step generates
    from): where each engine took it from and what that cost."""
    m: dict[str, float] = {}
    sends = [r for r in trains if r.weight_sync_memory_send_seconds is not None]
    if sends:
        m["weight_sync_memory_send_seconds"] = max(r.weight_sync_memory_send_seconds for r in sends)
        m["weight_sync_memory_send_bytes"] = sum(r.weight_sync_memory_send_bytes for r in sends)
        m["weight_sync_memory_send_hash_seconds"] = max(r.weight_sync_memory_send_hash_seconds for r in sends)
        m["weight_sync_memory_send_failures"] = sum(r.weight_sync_memory_send_failed for r in sends)
    if rollouts:
        m["weight_load_disk_seconds"] = max(r.weight_load_disk_seconds or 0.0 for r in rollouts)
        m["weight_sync_memory_load_seconds"] = max(r.weight_sync_memory_load_seconds or 0.0 for r in rollouts)
        m["weight_sync_memory_receive_seconds"] = max(r.weight_sync_memory_receive_seconds or 0.0 for r in rollouts)
        m["weight_sync_memory_receive_bytes"] = max(r.weight_sync_memory_receive_bytes or 0 for r in rollouts)
        for source in ("memory", "disk"):
            m[f"weight_loads_from_{source}"] = sum(r.weights_from == source for r in rollouts)
    return m


# -- the training ranks ---------------------------------------------------------------------------------
def connect_sender(cfg: GRPOConfig, sync: WeightSyncConfig) -> str:
    """On every training rank: ranks with dp = 0 gather their whole tensors (a collective over TP,
    as for a shard write); dp = tp = 0 ranks join the channel as pipeline rank pp's source.
    Returns "" or the one-line error that kept it out of the channel."""
    set_threads(cfg, "train")
    senders = worker_state().senders
    engine = worker_state().rank(cfg.run_name)
    old = senders.pop(cfg.run_name, None)  # an engine's receiving thread in this process stays
    if old is not None:
        old.close()
    coord = engine.coord
    if coord.dp != 0:
        return ""
    state = engine.hf_state()
    if coord.tp != 0:
        return ""
    try:
        senders[cfg.run_name] = WeightSender.connect(sync, coord.pp, state)
    except Exception as exc:
        senders[cfg.run_name] = None
        return f"{type(exc).__name__}: {exc}"
    return ""


def send_version(run_name: str, state: dict | None, version: int) -> dict[str, float]:
    """Announce and send this rank's shard of ``version`` (its HF-named tensors; None on ranks that
    send nothing). A failed send leaves the version to disk and closes this rank's end."""
    senders = worker_state().senders
    sender = senders.get(run_name)
    if state is None or run_name not in senders:
        return {}
    out = {"weight_sync_memory_send_seconds": 0.0, "weight_sync_memory_send_bytes": 0,
           "weight_sync_memory_send_hash_seconds": 0.0, "weight_sync_memory_send_failed": 0}
    if sender is None:  # the channel failed earlier: disk until it reopens
        return out
    t0 = time.perf_counter()
    try:
        sender.announce(version)
        stats = sender.send(state, version)
    except WeightSyncError as exc:
        log.warning("weight sync: v%d goes by disk only: %s", version, exc)
        sender.close()
        senders[run_name] = None
        return {**out, "weight_sync_memory_send_seconds": time.perf_counter() - t0,
                "weight_sync_memory_send_failed": 1}
    return {**out, "weight_sync_memory_send_seconds": time.perf_counter() - t0,
            "weight_sync_memory_send_bytes": stats.num_bytes,
            "weight_sync_memory_send_hash_seconds": stats.hash_seconds}


# -- the engines ----------------------------------------------------------------------------------------
def _engine_specs(policy_path: str) -> list:
    """(HF name, shape, dtype) of the engine's whole model, from the version's config.json."""
    import torch

    with torch.device("meta"):
        model = build_stage(DecoderConfig.from_hf(load_hf_config(policy_path)))
    return tensor_specs(hf_state(model))


def start_receiver(run_name: str, sync: WeightSyncConfig, engine_index: int, policy_path: str, keep: int) -> str:
    """On an engine worker (client.run): replace the run's receiving thread by one on ``sync``;
    returns at once, the thread joins the channel."""
    streams = worker_state().streams
    stream = streams.pop(run_name, None)
    if stream is not None:
        stream.close()
    specs = _engine_specs(policy_path)
    streams[run_name] = VersionStream(lambda: WeightReceiver.connect(sync, engine_index, specs), keep,
                                       name=f"weight-sync-{sync.channel}")
    return sync.channel


def close_endpoints(run_name: str) -> None:
    """Close this process's sender and receiving thread of the run, if any (client.run)."""
    worker_state().close_endpoints(run_name)
