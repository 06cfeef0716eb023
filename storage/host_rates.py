"""Measured matmul rates (stages/perf/matmul_rate.py), cached per host in one JSON file.

The caller passes the file; by convention ``<runs_dir>/_cache/host_rates.json`` (the folder
:class:`storage.run_folder.RunFolder` calls ``cache_root``, shared by the runs of a runs_dir)::

    {"host=vm/cpu=AMD EPYC/torch=2.13.0+cpu/dtype=float32/device=cpu/threads=1/mm=512x576x1536": 1.01e11}

The key names everything the rate depends on: the host, its CPU model (/proc/cpuinfo "model name";
the GPU's name for a CUDA device), the torch version, dtype, device, threads and the matmul shape,
so another machine, an upgraded torch or a changed shape measures afresh.

A cache must never stop a run: a missing, unreadable or corrupt file reads as empty (the rate is
measured again and the file rewritten), and a file that cannot be written is logged and skipped.
Writes go to a temporary file in the same folder and ``os.replace`` it, so a reader never sees half a
file. Processes of one host measure one at a time under an ``flock`` on ``<file>.lock``, so
concurrent workers neither slow each other's measurement nor measure twice.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import math
import os
import platform
import socket
import tempfile
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Optional

import torch

from stages.perf.matmul_rate import MATMUL_SHAPE, dtype_name, measure_matmul_rate

__all__ = ["HOST_RATES_FILE", "HostRatesError", "host_cores", "host_rate_key", "load_host_rates", "save_host_rates",
           "matmul_rate"]

log = logging.getLogger(__name__)

HOST_RATES_FILE = "host_rates.json"
"""File name of the cache in the runs' shared cache folder."""
_CPUINFO = "/proc/cpuinfo"


class HostRatesError(RuntimeError):
    """The cache file could not be written; the message names the file."""


def host_cores() -> int:
    """Cores this process may run on: the thread count a rate "with every core" is measured at."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def host_rate_key(dtype: str | torch.dtype, device: str = "cpu", threads: Optional[int] = None) -> str:
    """The cache key of a rate measured here: host/cpu/torch/dtype/device/threads/mm.
    threads None: torch's current intra-op thread count."""
    dev = torch.device(device)
    threads = torch.get_num_threads() if threads is None else threads
    model = _cpu_model()
    if dev.type == "cuda" and torch.cuda.is_available():
        model = torch.cuda.get_device_name(dev)
    shape = "x".join(str(d) for d in MATMUL_SHAPE)
    return (f"host={socket.gethostname()}/cpu={model}/torch={torch.__version__}/dtype={dtype_name(dtype)}/"
            f"device={dev}/threads={threads}/mm={shape}")


def _cpu_model() -> str:
    try:
        with open(_CPUINFO, encoding="utf-8", errors="replace") as f:
            for line in f:
                name, sep, value = line.partition(":")
                if sep and name.strip() == "model name":
                    return value.strip()
    except OSError:
        pass  # not Linux: fall back to what platform knows
    return platform.processor() or platform.machine() or "unknown"


def load_host_rates(path: str | Path) -> dict[str, float]:
    """key -> FLOP/s of the cache file; {} when it is missing, unreadable or not a cache (logged).
    Entries that are not positive finite numbers are dropped."""
    try:
        raw = json.loads(Path(path).read_text(encoding="utf-8"))
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as exc:  # ValueError: bad JSON or bad UTF-8
        log.warning("ignoring the unreadable host-rate cache %s (%s); measuring again", path, exc)
        return {}
    if not isinstance(raw, dict):
        log.warning("ignoring the host-rate cache %s: it holds a %s, not a JSON object", path, type(raw).__name__)
        return {}
    return {str(k): float(v) for k, v in raw.items()
            if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v > 0}


def save_host_rates(path: str | Path, rates: Mapping[str, float]) -> None:
    """Write the whole cache atomically (a temporary file in the same folder, then ``os.replace``)."""
    path = Path(path)
    tmp = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".partial", dir=path.parent)
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump(dict(sorted(rates.items())), f, indent=1)
            f.write("\n")
        os.chmod(tmp, 0o644)  # mkstemp makes it 0600; other users' runs may share the cache
        os.replace(tmp, path)
    except OSError as exc:
        if tmp is not None:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
        raise HostRatesError(f"cannot write the host-rate cache {path}: {exc}") from exc


@contextlib.contextmanager
def _host_lock(path: Path) -> Iterator[None]:
    """Exclusive flock on ``<path>.lock`` while held; unlocked (logged) where no lock can be had."""
    with contextlib.ExitStack() as stack:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            lock = stack.enter_context(open(f"{path}.lock", "a"))
            fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        except OSError as exc:
            log.warning("measuring without the lock of %s (%s)", path, exc)
        yield


def matmul_rate(cache_path: str | Path, dtype: str | torch.dtype, device: str = "cpu",
                threads: Optional[int] = None, refresh_seconds: float = 0.0) -> float:
    """FLOP/s of this host's matmul in ``dtype`` on ``device`` with ``threads`` (None: torch's current
    count): the cached value, else measured (:func:`stages.perf.matmul_rate.measure_matmul_rate`,
    about a second) and written to ``cache_path``. ``refresh_seconds`` > 0: measure again for that
    long even when cached, and keep the higher of the two. The file holds the highest rate seen, the
    machine's peak: a measurement beside busy processes reads low, and a later quiet one raises it.
    Call it before the workers start."""
    threads = torch.get_num_threads() if threads is None else threads
    key = host_rate_key(dtype, device, threads)
    path = Path(cache_path)
    cached = load_host_rates(path).get(key)
    if cached is not None and refresh_seconds <= 0:
        return cached
    with _host_lock(path):
        rates = load_host_rates(path)  # another process may have measured while this one waited
        if key in rates and refresh_seconds <= 0:
            return rates[key]
        measured = measure_matmul_rate(dtype, device, threads, seconds=refresh_seconds if key in rates else 1.0)
        if rates.get(key, 0.0) >= measured:
            return rates[key]
        rate = rates[key] = measured
        try:
            save_host_rates(path, rates)
        except HostRatesError as exc:
            log.warning("%s; the rate %.3g FLOP/s is used but not cached", exc, rate)
    return rate
