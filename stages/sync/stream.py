"""A rollout engine's end of the weight-sync channel, run in a thread of its own.

The engine's process generates in its task thread while new versions arrive: a
:class:`VersionStream` connects a :class:`~stages.sync.channel.WeightReceiver`, waits (polling the
channel's store, never inside a broadcast) until a source announces the next sync, receives it,
and keeps a copy of each version's tensors until the engine takes it. So a training rank's send
completes as soon as the bytes have moved, whatever the engine is doing, and the engine asks for
exactly the version a step names (:meth:`VersionStream.take`).

Memory: the receive buffers (one model) plus up to ``keep`` received versions.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Callable, Optional

import torch

from stages.sync.channel import WeightReceiver
from stages.sync.config import PolicyTag, SyncStats, WeightSyncError

__all__ = ["ReceivedVersion", "VersionStream"]

# An idle receiver looks for the next announcement this often: the most a send waits for it to
# join, for one store round trip (~0.1 ms) per look.
_POLL_S = 0.005


@dataclass(frozen=True)
class ReceivedVersion:
    tag: PolicyTag
    tensors: dict[str, torch.Tensor]
    """HF-named tensors, owned (copied out of the receive buffers)."""
    stats: SyncStats
    copy_seconds: float
    """Copying the tensors out of the receive buffers, after ``stats.seconds``."""


class VersionStream:
    """Receives every announced version in a daemon thread; :meth:`take` hands one over.

    ``connect`` builds the receiver (it joins the channel's rendezvous, bounded by the channel's
    timeout). Any failure ends the thread and is kept in :attr:`error`; later :meth:`take` calls
    answer None, so the caller loads that version another way.
    """

    def __init__(self, connect: Callable[[], WeightReceiver], keep: int = 2, name: str = "weight-sync-receiver"):
        if keep < 1:
            raise ValueError(f"keep={keep} must be >= 1 (received versions held until taken)")
        self.keep = keep
        self.error: Optional[str] = None
        self._connect = connect
        self._receiver: Optional[WeightReceiver] = None
        self._received: dict[int, ReceivedVersion] = {}
        self._cond = threading.Condition()
        self._stop = threading.Event()
        self._connected = False
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    # -- the receiving thread -------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            receiver = self._connect()
        except Exception as exc:
            self._end(f"connecting: {type(exc).__name__}: {exc}")
            return
        with self._cond:
            self._receiver, self._connected = receiver, True
            self._cond.notify_all()
        try:
            while not self._stop.is_set():
                announced = receiver.announced()
                if announced is None:
                    self._stop.wait(_POLL_S)
                    continue
                tag, views, stats = receiver.receive()
                if tag.version != announced:
                    raise WeightSyncError(f"sync announced as v{announced} carried v{tag.version}")
                t0 = time.perf_counter()
                tensors = {name: t.clone() for name, t in views.items()}
                item = ReceivedVersion(tag, tensors, stats, time.perf_counter() - t0)
                with self._cond:
                    self._received[tag.version] = item
                    for old in sorted(self._received)[:-self.keep]:
                        del self._received[old]
                    self._cond.notify_all()
        except Exception as exc:
            self._end(f"{type(exc).__name__}: {exc}")
        finally:
            receiver.close()

    def _end(self, error: Optional[str]) -> None:
        with self._cond:
            if error and not self._stop.is_set():
                self.error = error
            self._stop.set()
            self._cond.notify_all()

    # -- the engine's side ----------------------------------------------------------------------------
    @property
    def alive(self) -> bool:
        return not self._stop.is_set()

    def take(self, version: int, timeout_s: float) -> tuple[Optional[ReceivedVersion], str]:
        """Policy ``version`` as received, and "" ; or None and why it is not here (never announced
        on this channel, the stream ended, or it did not arrive within ``timeout_s``). Versions
        older than ``version`` are dropped: a step never asks for an older one than its predecessor.
        """
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while not self._connected and self.alive:  # the rendezvous is bounded by its own timeout
                if not self._cond.wait(max(0.0, deadline - time.monotonic())):
                    return None, f"the channel did not connect within {timeout_s:.0f} s"
            receiver = self._receiver
        if version not in self._received:
            if receiver is None or not self.alive:
                return None, f"the channel is closed ({self.error or 'stopped'})"
            try:
                if not receiver.was_announced(version):
                    return None, f"v{version} was not sent on this channel"
            except WeightSyncError as exc:
                return None, str(exc)
        with self._cond:
            while version not in self._received:
                if not self.alive:
                    return None, f"the channel failed before v{version} arrived ({self.error or 'stopped'})"
                if not self._cond.wait(max(0.0, deadline - time.monotonic())):
                    return None, f"v{version} was announced but did not arrive within {timeout_s:.0f} s"
            for old in [v for v in self._received if v < version]:
                del self._received[old]
            return self._received[version], ""

    def close(self) -> None:
        """Stop the thread (at its next poll; a receive in progress ends at its timeout)."""
        self._end(None)
        receiver = self._receiver
        if receiver is not None and not self._thread.is_alive():
            receiver.close()
