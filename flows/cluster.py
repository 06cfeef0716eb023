"""Dask cluster set-up: an embedded local cluster, or an existing scheduler.

Workers carry resources: ``train`` (one per training rank, pp x dp x tp of them), ``rollout``
(one per generation engine), ``eval`` (held-out evaluation, when eval.path is set); plain workers
take reward, advantage and IO tasks. A task asking for a
resource no worker has would wait forever in Dask, so :func:`check_pools` fails at start-up instead.

Pools name workers by their Dask worker NAME: a worker process that dies is restarted by its nanny
under the same name at a new address, so the run re-resolves names instead of keeping addresses.
A training rank's state lives in its worker process, so a pool also records the address each rank
was built on: :func:`lost_workers` tells which of them are gone, and :func:`restart_train_workers`
gives every rank a fresh process to be rebuilt in.
"""

from __future__ import annotations

import ipaddress
import logging
import os
import subprocess
import sys
import threading
import time
from dataclasses import dataclass

import dask
from distributed import Client, Nanny, Scheduler, SpecCluster
from distributed.deploy.cluster import Cluster

from flows.config import WORKER_SILENCE_S, GRPOConfig

__all__ = ["ClusterError", "Pools", "start_cluster", "check_pools", "dashboard_link", "worker_addresses",
           "run_on_workers", "lost_workers", "restart_train_workers", "worker_resources"]

log = logging.getLogger(__name__)


class ClusterError(RuntimeError):
    """The cluster lacks a worker pool the run needs."""


@dataclass(frozen=True)
class Pools:
    """The run's worker pools by name, and where each worker was when they were resolved."""

    train: tuple[str, ...]
    """Worker names, index = global training rank (stages/layout/mesh.py)."""
    rollout: tuple[str, ...]
    """Worker names of the generation engines."""
    plain: tuple[str, ...] = ()
    """Worker names with none of the resources: gates, reward, advantage and publish run there when
    there are any, so with several steps in flight they never queue behind a long train or rollout task."""
    addresses: tuple[tuple[str, str], ...] = ()
    """(name, address) of every pooled worker at resolution time."""
    eval: tuple[str, ...] = ()
    """Worker names with the ``eval`` resource: held-out evaluations run there (flows/evaluate.py),
    so an evaluation never holds back a step's gate, rollout or training task."""
    silence_s: float = WORKER_SILENCE_S
    """A pooled worker whose last heartbeat the scheduler got longer ago than this is lost: a frozen
    (stopped, deadlocked) process holds its tasks and its peers' collectives until it is killed
    (``cluster.worker_silence_s``)."""

    def address(self, name: str) -> str:
        return dict(self.addresses)[name]

    @property
    def train_addresses(self) -> tuple[str, ...]:
        return tuple(self.address(n) for n in self.train)

    @property
    def train_host(self) -> str:
        """Host of rank 0's worker: where the process-group rendezvous listens."""
        return self.address(self.train[0]).split("://")[-1].rsplit(":", 1)[0]


# glibc malloc settings of the embedded workers. Dask's nanny starts workers with
# MALLOC_TRIM_THRESHOLD_=64 KiB (hand freed memory back to the OS at once), which also pins the mmap
# threshold at 128 KiB: every activation or gradient buffer above that is a fresh mmap whose pages
# fault in and are zeroed on each use, ~50k page faults (a third of the time) per training step of
# the tiny config. These keep buffers up to 32 MiB (glibc's own dynamic ceiling) in the heap and
# trim only beyond 256 MiB free.
WORKER_MALLOC_ENV = {"MALLOC_TRIM_THRESHOLD_": str(256 << 20), "MALLOC_MMAP_THRESHOLD_": str(32 << 20)}

# Periodic work of every Dask server of the embedded cluster (the scheduler and the nannies in the
# driver, each worker): the event-loop health tick (default every 20 ms) and the psutil system
# monitor (default every 500 ms). With the defaults an idle embedded cluster of the tiny config
# keeps 15% of a core busy; these leave 3% (docs/performance.md). A tick of 500 ms still catches
# an event loop blocked past distributed.admin.tick.limit (3 s); the monitor feeds only the
# dashboard's host graphs.
CLUSTER_TIMERS = {"distributed.admin.tick.interval": "500ms", "distributed.admin.system-monitor.interval": "2s"}


class _NannyCluster(SpecCluster):
    """A SpecCluster that keeps every nanny until the cluster closes.

    SpecCluster closes the nanny of a worker whose name the scheduler still lacks
    ``distributed.deploy.lost-worker-timeout`` (15 s) after removing it. Here each nanny restarts its
    own worker process, and that restart can take longer than 15 s (a loaded host importing torch), or
    the worker can die again within 15 s of a previous death: closing the nanny then kills the
    restart in progress and the worker never comes back. The run's bounded waits
    (``cluster.worker_wait_s``) decide when a worker is lost, not this timer."""

    def _update_worker_status(self, op, msg):
        Cluster._update_worker_status(self, op, msg)  # the scheduler's view only; no nanny closed


def _worker(resources: dict[str, int], listen: str) -> dict:
    # One thread per worker process: torch ops inside use that process's own threads. The nanny
    # hands ``host`` to its worker; without it the worker's comm and dashboard bind every interface.
    return {"cls": Nanny, "options": {"nthreads": 1, "resources": resources, "memory_limit": 0, "host": listen,
                                      "dashboard_address": _with_port(listen, 0)}}


def _with_port(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def _detach_resource_tracker() -> None:
    """Start multiprocessing's resource tracker in a session of its own, before the embedded
    cluster's nannies create their semaphores (/dev/shm/sem.mp-*), so that it outlives a kill of
    the run's whole process group (``kill -9 -- -PGID``) and unlinks what the killed processes
    left: it does so once every process holding its pipe is gone. Started in the run's group, it
    died with them and the semaphores stayed until reboot. It ignores SIGINT and SIGTERM itself.

    CPython starts the tracker on first use and offers no way to start it elsewhere, so this fills
    in its process id and pipe (``multiprocessing.resource_tracker``'s private ``_fd``/``_pid``,
    the same in 3.11 to 3.13); a tracker already running, or another implementation, is left as is."""
    from multiprocessing import resource_tracker

    tracker = getattr(resource_tracker, "_resource_tracker", None)
    if sys.platform != "linux" or tracker is None or getattr(tracker, "_fd", 0) is not None \
            or not hasattr(tracker, "_pid"):
        return
    r, w = os.pipe()
    try:
        proc = subprocess.Popen([sys.executable, "-B", "-c",
                                 f"from multiprocessing.resource_tracker import main; main({r})"],
                                pass_fds=(r,), stdin=subprocess.DEVNULL, start_new_session=True)
    except OSError as exc:
        os.close(w)
        log.debug("resource tracker left to multiprocessing: %s", exc)
        return
    finally:
        os.close(r)
    tracker._fd, tracker._pid = w, proc.pid


class _ClosedTabNoise(logging.Filter):
    """Drops the dashboard's records of a browser tab that went away while the server wrote to it:
    tornado's "Uncaught exception" with a WebSocketClosedError or StreamClosedError, and Bokeh's
    "Failed sending message as connection was closed". Any other record passes."""

    _CLOSED = ("WebSocketClosedError", "StreamClosedError")

    def filter(self, record: logging.LogRecord) -> bool:
        if record.exc_info and record.exc_info[1] is not None:
            exc: BaseException | None = record.exc_info[1]
            while exc is not None:
                if type(exc).__name__ in self._CLOSED:
                    return False
                exc = exc.__cause__ or exc.__context__
        return "connection was closed" not in record.getMessage()


def _quiet_dashboard() -> None:
    """The embedded scheduler's dashboard runs in this process: a closed tab is no error of the run."""
    for name in ("tornado.application", "bokeh.server.views.ws", "bokeh.server.protocol_handler"):
        logger = logging.getLogger(name)
        if not any(isinstance(f, _ClosedTabNoise) for f in logger.filters):
            logger.addFilter(_ClosedTabNoise())


def worker_resources(cfg: GRPOConfig) -> dict[str, dict[str, int]]:
    """The workers a run of ``cfg`` asks for, name -> Dask resources: a ``train`` worker per
    training rank (colocated: the first rollout.num_engines also ``rollout``), decoupled a
    ``rollout`` worker per engine, cluster.num_plain_workers with none, and an ``eval`` worker when
    eval is on. The embedded cluster starts these; flows/deploy.py writes them for a cluster of
    one's own."""
    workers: dict[str, dict[str, int]] = {}
    for rank in range(cfg.train.world_size):
        workers[f"train-{rank}"] = {"train": 1}
        if cfg.cluster.colocated_pools and rank < cfg.rollout.num_engines:
            workers[f"train-{rank}"]["rollout"] = 1
    if not cfg.cluster.colocated_pools:
        for i in range(cfg.rollout.num_engines):
            workers[f"rollout-{i}"] = {"rollout": 1}
    for i in range(cfg.cluster.num_plain_workers):
        workers[f"plain-{i}"] = {}
    if cfg.eval.enabled:
        workers["eval-0"] = {"eval": 1}
    return workers


def start_cluster(cfg: GRPOConfig, timers: dict[str, str] = CLUSTER_TIMERS) -> tuple[Client, SpecCluster | None]:
    """A client on the configured scheduler, or on a new embedded cluster sized for ``cfg`` whose
    Dask servers run with the config settings ``timers`` ({}: Dask's own)."""
    if cfg.cluster.scheduler_address:
        client = Client(cfg.cluster.scheduler_address, timeout="30s")
        _announce_dashboard(client)
        return client, None
    listen = cfg.cluster.listen
    if not _is_loopback(listen):
        log.warning("cluster.listen=%s: the run's scheduler, workers and TCPStores accept connections from "
                    "every host that reaches %s, without authentication (docs/reliability.md)", listen, listen)
    workers = {name: _worker(res, listen) for name, res in worker_resources(cfg).items()}
    # Worker processes configure logging when they import distributed, from the environment.
    os.environ.setdefault("DASK_LOGGING__DISTRIBUTED", "warning")
    dask.config.set({"logging.distributed": "warning"})
    scheduler = {"cls": Scheduler, "options": {"dashboard_address": _with_port(listen, 0), "host": listen}}
    for name in ("distributed.worker", "distributed.nanny", "distributed.scheduler", "distributed.core"):
        logging.getLogger(name).setLevel(logging.WARNING)
    # The nanny reads these when it is made and sets them before every (re)start of its worker; a
    # value already in os.environ wins over the config, so both say the same.
    env = dict(WORKER_MALLOC_ENV)
    if _is_loopback(listen):
        # gloo's pair sockets listen on the address the host name resolves to, which may be a LAN
        # address; on loopback the ranks' process groups stay on this machine too.
        env.setdefault("GLOO_SOCKET_IFNAME", os.environ.get("GLOO_SOCKET_IFNAME", "lo"))
    os.environ.update(env)
    settings = {f"distributed.nanny.pre-spawn-environ.{k}": v for k, v in env.items()}
    settings["distributed.worker.profile.enabled"] = cfg.cluster.worker_profiler  # the nanny hands it on
    settings.update(timers)
    _detach_resource_tracker()
    _quiet_dashboard()
    with dask.config.set(settings):
        cluster = _NannyCluster(workers=workers, scheduler=scheduler, silence_logs=logging.WARNING,
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


def _name(address: str, info: dict) -> str:
    # A worker started without --name is named after its address.
    name = info.get("name")
    return address if name is None else str(name)


def _workers(client: Client) -> dict[str, dict]:
    """Address -> info of every worker, asked of the scheduler now. (``client.scheduler_info()``
    returns a cache that the client's background refresh may swap for one without workers.)"""
    return client.sync(client.scheduler.identity, n_workers=-1)["workers"]


def worker_addresses(client: Client) -> dict[str, str]:
    """Worker name -> address of every worker the scheduler knows now."""
    return {_name(a, w): a for a, w in _workers(client).items()}


def check_pools(client: Client, cfg: GRPOConfig, wait_s: float | None = None) -> Pools:
    """The train and rollout workers, or a :class:`ClusterError` naming the missing resource."""
    t = cfg.train
    world = t.world_size
    wait_s = cfg.cluster.worker_wait_s if wait_s is None else wait_s
    try:
        client.wait_for_workers(1, timeout=wait_s)
    except TimeoutError as exc:
        raise ClusterError(f"no Dask worker joined within {wait_s:.0f} s") from exc

    def having(resource: str) -> list[str]:
        return sorted((a for a, w in workers.items() if w.get("resources", {}).get(resource, 0) >= 1),
                      key=lambda a: (_name(a, workers[a]), a))

    # A worker may still be joining, or restarting after a crash: wait for the pools to fill.
    deadline = time.monotonic() + wait_s
    while True:
        workers = _workers(client)
        train, rollout = having("train"), having("rollout")
        # The embedded cluster's eval worker too; a cluster of one's own may have none (the plain
        # workers evaluate then).
        evals_ready = not cfg.eval.enabled or cfg.cluster.scheduler_address or having("eval")
        if (len(train) >= world and rollout and evals_ready) or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    if len(train) < world:
        raise ClusterError(
            f"train.pipeline_model_parallel_size x data_parallel_size x tensor_model_parallel_size = "
            f"{t.pipeline_model_parallel_size} x {t.data_parallel_size} x {t.tensor_model_parallel_size} = {world} "
            f"training ranks need {world} workers with the 'train' resource, the cluster has {len(train)}: "
            "start workers with --resources train=1")
    if not rollout:
        raise ClusterError("no worker offers the 'rollout' resource: start one with --resources rollout=1")
    train, rollout = train[:world], rollout[: cfg.rollout.num_engines]
    plain = sorted(a for a, w in workers.items() if not {"train", "rollout", "eval"} & set(w.get("resources", {})))
    evals = having("eval")
    return Pools(tuple(_name(a, workers[a]) for a in train), tuple(_name(a, workers[a]) for a in rollout),
                 tuple(_name(a, workers[a]) for a in plain),
                 tuple((_name(a, workers[a]), a) for a in dict.fromkeys(train + rollout)),
                 eval=tuple(_name(a, workers[a]) for a in evals), silence_s=cfg.cluster.worker_silence_s)


def _heard_from(dask_scheduler) -> dict[str, tuple[str, float]]:
    """On the scheduler: worker name -> (address, seconds since its last heartbeat)."""
    now = time.time()
    return {_name(a, {"name": ws.name}): (a, now - ws.last_seen) for a, ws in dask_scheduler.workers.items()}


def run_on_workers(client: Client, function, *args, timeout_s: float, quiet_s: float = 10.0) -> None:
    """``client.run(function, *args)`` on every worker heard from in the last ``quiet_s``, waiting
    at most ``timeout_s``: for the run's clean-up, which must not wait on a frozen worker (such a
    worker never answers; the cluster's close, or its owner, kills it). Failures are logged."""
    heard = client.run_on_scheduler(_heard_from)
    targets = [a for a, silent_s in heard.values() if silent_s <= quiet_s]
    skipped = sorted(f"{n} ({a})" for n, (a, silent_s) in heard.items() if silent_s > quiet_s)
    if skipped:
        log.warning("%s on every worker but %s, silent for more than %g s", function.__name__,
                    ", ".join(skipped), quiet_s)
    failed: list[BaseException] = []

    def call() -> None:
        try:
            client.run(function, *args, workers=targets)
        except BaseException as exc:  # reported by the caller's thread
            failed.append(exc)

    thread = threading.Thread(target=call, name=f"run-{function.__name__}", daemon=True)
    thread.start()
    thread.join(timeout_s)
    if thread.is_alive():
        log.warning("%s did not finish on every worker within %.0f s; going on without it", function.__name__,
                    timeout_s)
    elif failed:
        log.warning("%s failed on a worker: %s: %s", function.__name__, type(failed[0]).__name__, failed[0])


def lost_workers(client: Client, pools: Pools, names: tuple[str, ...] | None = None) -> list[str]:
    """Of ``names`` (default: the training workers), those no longer at the address they had when
    ``pools`` was resolved (dead, or restarted in a new process: a new address), and those silent
    for more than ``pools.silence_s`` (frozen: :func:`restart_train_workers` has their nannies
    kill them)."""
    heard = client.run_on_scheduler(_heard_from)
    lost = []
    for n in pools.train if names is None else names:
        address, silent_s = heard.get(n, (None, 0.0))
        if address != pools.address(n):
            lost.append(n)
        elif silent_s > pools.silence_s:
            log.warning("worker %s (%s) has sent the scheduler no heartbeat for %.0f s (cluster.worker_silence_s="
                        "%g): frozen, treated as lost", n, address, silent_s, pools.silence_s)
            lost.append(n)
    return lost


def _wait_for_names(client: Client, names: tuple[str, ...], old: set[str], wait_s: float) -> None:
    """Wait until every worker in ``names`` is up at an address not in ``old``."""
    deadline = time.monotonic() + wait_s
    while True:
        now = worker_addresses(client)
        missing = [n for n in names if n not in now or now[n] in old]
        if not missing:
            return
        if time.monotonic() > deadline:
            raise ClusterError(f"workers {', '.join(missing)} did not come back within cluster.worker_wait_s="
                               f"{wait_s:.0f} s; check their nannies' logs, or raise cluster.worker_wait_s")
        time.sleep(0.2)


def restart_train_workers(client: Client, cfg: GRPOConfig, pools: Pools) -> Pools:
    """Give every training rank a fresh worker process and return the re-resolved pools.

    The survivors of a lost rank hold an aborted process group that torch cannot re-initialise in
    the same process (stages/train/faults.py), so they are restarted too; a worker that died is
    already being restarted by its nanny under the same name."""
    wait_s = cfg.cluster.worker_wait_s
    old = set(pools.train_addresses)
    now = worker_addresses(client)
    survivors = [now[n] for n in pools.train if now.get(n) == pools.address(n)]
    if survivors:
        client.restart_workers(survivors, timeout=wait_s, raise_for_error=False)
    _wait_for_names(client, pools.train, old, wait_s)
    fresh = check_pools(client, cfg, wait_s)
    if fresh.train != pools.train:
        raise ClusterError(f"the training workers changed from {', '.join(pools.train)} to {', '.join(fresh.train)} "
                           "across a restart; rank placement must stay fixed")
    return fresh
