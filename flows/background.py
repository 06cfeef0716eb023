"""The loop's bookkeeping off its critical path.

After step k finishes, the driver writes its lineage (MLflow calls, tens of milliseconds each with
the sqlite store, the step's trace, sample table and plots) and creates step k + 1's Zarr group
ahead of its submission. Both run while step k + 1 does, instead of delaying its submission.

- :class:`BackgroundProcess` runs the lineage: calls of importable functions, in order, in a child
  process at the lowest CPU priority. While a loop runs, only that process calls MLflow.
- :class:`BackgroundQueue` runs the small, prompt work (the next step's Zarr group) on one thread
  of the driver, also at the lowest priority (Linux: niceness is per thread).

On a host whose cores the workers fill, bookkeeping beside a pipeline pass is not free even when
it overlaps: each time a rank waits for a microbatch, and wakes to find its core taken, the other
ranks wait with it. Lowering a thread's priority helps only so far: the thread shares the driver's
GIL with the embedded Dask scheduler and the client, and a low-priority thread preempted while it
holds the GIL stalls every task transition behind it. A process shares no lock with them, so its
niceness costs the scheduler nothing (docs/performance.md, "The whole iteration").
"""

from __future__ import annotations

import importlib
import logging
import multiprocessing
import os
import sys
import threading
import time
import traceback
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable

__all__ = ["BackgroundError", "BackgroundProcess", "BackgroundQueue"]

log = logging.getLogger(__name__)


def _lower_priority(niceness: int) -> None:
    """This thread's niceness (Linux only: elsewhere the call would renice the whole process)."""
    if sys.platform == "linux" and niceness:
        try:
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), niceness)
        except OSError as exc:  # e.g. a sandbox forbidding it: run at the normal priority
            log.debug("background thread keeps its priority: %s", exc)


class BackgroundQueue:
    """Calls run in submission order on one thread. A failed call fails the run: the next
    :meth:`submit` or :meth:`drain` raises its error; a call cancelled before it started is
    skipped. At most ``max_pending`` calls wait; a further submit first waits for the oldest, so
    bookkeeping slower than the steps holds the loop back instead of piling up."""

    def __init__(self, max_pending: int = 16, niceness: int = 19):
        if max_pending < 1:
            raise ValueError(f"max_pending={max_pending} must be >= 1")
        self.max_pending = max_pending
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="grpoflow-background",
                                        initializer=_lower_priority, initargs=(niceness,))
        self._pending: deque[Future] = deque()

    def submit(self, fn: Callable, *args, **kwargs) -> Future:
        """Run ``fn(*args, **kwargs)`` after every call submitted before it; its future."""
        self._reap(wait_for=self.max_pending - 1)
        future = self._pool.submit(fn, *args, **kwargs)
        self._pending.append(future)
        return future

    def _reap(self, wait_for: int) -> None:
        """Drop finished calls (raising the first error) until at most ``wait_for`` are pending."""
        while self._pending and (self._pending[0].done() or len(self._pending) > wait_for):
            future = self._pending.popleft()
            if not future.cancelled():
                future.result()

    def drain(self) -> None:
        """Wait for every call submitted so far; raises the first one's error."""
        self._reap(wait_for=0)

    def close(self) -> None:
        """Wait for the calls still queued and stop the thread; their errors are logged, not raised
        (for a run that is already failing: call :meth:`drain` first to see them)."""
        for future in self._pending:
            try:
                if not future.cancelled():
                    future.result()
            except Exception as exc:
                log.warning("background call failed: %s", exc)
        self._pending.clear()
        self._pool.shutdown(wait=True)


class BackgroundError(RuntimeError):
    """The background process exited, or a call in it outlasted its time limit."""


def _serve(conn, niceness: int, preload: tuple[str, ...]) -> None:
    """The child's loop: import ``preload`` (at the parent's priority), then run each ``(fn, args,
    kwargs)`` received, send back ``(ok, value)``; stop at ``None`` or when the parent's end of the
    pipe closes."""
    for module in preload:
        try:
            importlib.import_module(module)
        except Exception:  # the call that needs it reports the error
            pass
    if niceness:
        try:
            os.nice(niceness)
        except OSError:  # a sandbox forbidding it: run at the normal priority
            pass
    while True:
        try:
            message = conn.recv()
        except EOFError:  # the parent is gone
            return
        if message is None:
            return
        fn, args, kwargs = message
        try:
            reply = (True, fn(*args, **kwargs))
        except BaseException as exc:  # noqa: BLE001 - every failure goes back to the caller
            exc.add_note("in the background process:\n" + traceback.format_exc().rstrip())
            reply = (False, exc)
        try:
            conn.send(reply)
        except Exception as exc:  # an unpicklable result or error: send what can be said of it
            conn.send((False, BackgroundError(f"{getattr(fn, '__qualname__', fn)}: {reply[1]!r} "
                                              f"could not be sent back ({exc})")))


class BackgroundProcess:
    """Calls of importable functions (and picklable arguments), run in submission order in one
    child process started with ``spawn``, at niceness ``niceness``. A function keeps state across
    calls in its module (the child imports it once). The child imports the ``preload`` modules
    before it lowers its priority, so a start on a busy host does not hold the first calls back.

    As :class:`BackgroundQueue`: a failed call fails the run (the next :meth:`submit` or
    :meth:`drain` raises its error, with the child's traceback as a note), and at most
    ``max_pending`` calls wait, so a child slower than the steps holds the loop back instead of
    piling up. A call that has not answered within ``timeout_s`` of the wait for it, or a child
    that exits, raises :class:`BackgroundError`."""

    def __init__(self, max_pending: int = 32, niceness: int = 19, timeout_s: float = 600.0,
                 name: str = "grpoflow-background", preload: tuple[str, ...] = ()):
        if max_pending < 1:
            raise ValueError(f"max_pending={max_pending} must be >= 1")
        if timeout_s <= 0:
            raise ValueError(f"timeout_s={timeout_s} must be > 0")
        self.max_pending, self.timeout_s = max_pending, timeout_s
        ctx = multiprocessing.get_context("spawn")  # no fork of a process running Dask's threads
        self._conn, child = ctx.Pipe()
        self._process = ctx.Process(target=_serve, args=(child, niceness, tuple(preload)), name=name, daemon=True)
        self._process.start()
        child.close()
        self._pending: deque[tuple[str, Future]] = deque()
        self._closed = False
        self._dead: BackgroundError | None = None

    @property
    def pid(self) -> int | None:
        return self._process.pid

    def submit(self, fn: Callable, *args, **kwargs) -> Future:
        """Run ``fn(*args, **kwargs)`` in the child after every call submitted before it; its future,
        resolved when a later :meth:`submit` or :meth:`drain` collects the answer."""
        if self._closed or self._dead is not None:
            raise self._dead or BackgroundError("the background process is closed")
        self._reap(wait_for=self.max_pending - 1)
        future: Future = Future()
        future.set_running_or_notify_cancel()
        try:
            self._conn.send((fn, args, kwargs))
        except (BrokenPipeError, ConnectionResetError) as exc:
            raise self._exited() from exc
        self._pending.append((getattr(fn, "__qualname__", repr(fn)), future))
        return future

    def _exited(self) -> BackgroundError:
        self._process.join(timeout=5)
        error = BackgroundError(f"the background process exited (code {self._process.exitcode}) with "
                                f"{len(self._pending)} call(s) unanswered")
        for _, future in self._pending:
            future.set_exception(error)
        self._pending.clear()
        self._dead = error
        return error

    def _receive(self, timeout_s: float) -> None:
        """The oldest call's answer into its future (raising its error), within ``timeout_s`` (what
        is left of the wait's ``self.timeout_s``)."""
        name, future = self._pending[0]
        if not self._conn.poll(timeout_s):
            raise BackgroundError(f"background call {name} did not answer within {self.timeout_s:g} s")
        try:
            ok, value = self._conn.recv()
        except (EOFError, ConnectionResetError) as exc:
            raise self._exited() from exc
        self._pending.popleft()
        if ok:
            future.set_result(value)
        else:
            future.set_exception(value)
            raise value

    def _reap(self, wait_for: int) -> None:
        """Collect answers that have arrived, then wait until at most ``wait_for`` calls are pending."""
        while self._pending and self._conn.poll(0):
            self._receive(0)
        deadline = time.monotonic() + self.timeout_s
        while len(self._pending) > wait_for:
            self._receive(max(0.0, deadline - time.monotonic()))

    def drain(self) -> None:
        """Wait for every call submitted so far; raises the first one's error."""
        self._reap(wait_for=0)

    def close(self) -> None:
        """Wait for the calls still queued (their errors are logged, not raised: call :meth:`drain`
        first to see them) and stop the child."""
        if self._closed:
            return
        self._closed = True
        stuck = False
        try:
            while self._pending:
                try:
                    self._receive(self.timeout_s)
                except BackgroundError as exc:  # gone, or stuck: stop it without waiting
                    log.warning("%s", exc)
                    self._pending.clear()
                    stuck = True
                except Exception as exc:
                    log.warning("background call failed: %s", exc)
            self._conn.send(None)
        except (OSError, EOFError):
            pass
        if not stuck:
            self._process.join(timeout=10)
        if self._process.is_alive():
            self._process.terminate()
            self._process.join(timeout=5)
        self._conn.close()
