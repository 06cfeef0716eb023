"""Reward functions run in a separate process that can be killed.

Threads cannot be stopped, so a reward that loops forever, leaks memory or crashes the interpreter
would take the scoring task down with it. Here the functions run in one child Python process per
(function list, memory limit), started with :mod:`subprocess` (Dask's worker processes are
daemonic and may not start :mod:`multiprocessing` children) and kept between calls:

* **time**: each sample gets ``timeout_s`` of wall clock; past it the child is killed (SIGKILL) and a
  fresh one started for the next sample. A batch of samples travels in one message and the child
  answers each as soon as it is scored, so the clock of a sample starts at its predecessor's answer
  (no round trip per sample).
* **memory**: the child caps its address space with ``RLIMIT_AS``; an allocation past it raises
  MemoryError there (or kills the child), which fails that sample only.
* **crashes**: a child that exits (segfault, ``os._exit``) fails the sample in flight; the next
  sample gets a fresh child.
* **data**: the child receives only the prompt text, completion text and the record's fields, runs
  in an empty temporary folder, and is never told the run folder or the store's path. This limits
  accidents, not attacks: it is not a security sandbox.
* **clean-up**: the parent removes the folder when it closes the child; a parent that is killed
  (a worker lost to SIGKILL, or one exiting with its driver, runs no clean-up) closes the child's
  stdin, and the child removes the folder itself before it exits, also when that happens while it
  is still starting. A child busy in a reward that never returns does not read its stdin: on Linux
  it asks the kernel for SIGTERM when its parent goes (``PR_SET_PDEATHSIG``), removes its folder and
  exits, so no reward child outlives its worker (short of a reward that holds the GIL in C code
  forever, which no signal handler can interrupt).
* **output**: what the functions print (stdout and stderr) goes to a file in the child's folder,
  not to the worker's terminal; after each call the parent logs at most
  :data:`OUTPUT_LOG_BYTES` of it, says how much more there was, and empties the file.

Messages are length-prefixed pickles over the child's stdin and a duplicate of its stdout; fd 1 of
the child is pointed at its output file, so a reward that prints does not corrupt the channel.
"""

from __future__ import annotations

import atexit
import logging
import os
import pickle
import select
import shutil
import signal
import struct
import subprocess
import sys
import tempfile
import time
from typing import Any, Optional

__all__ = ["OUTPUT_LOG_BYTES", "RewardProcess", "RewardProcessError", "SampleFailed", "close_reward_processes",
           "reward_process"]

log = logging.getLogger(__name__)

OUTPUT_LOG_BYTES = 2048
"""The most of a reward's printed output one scoring call logs (the rest is counted, not shown)."""

_HEADER = struct.Struct(">Q")
_FOLDER_PREFIX = "grpoflow-reward-"  # the child's working folder, which it may remove itself
_OUTPUT_FILE = ".reward-output"  # in that folder: what the functions print
_PR_SET_PDEATHSIG = 1  # linux/prctl.h
_CHILD = "from stages.reward.isolated import _child_main; _child_main()"
# Numeric libraries start a thread pool per core; each reserves address space that counts
# against RLIMIT_AS, so the child keeps to one thread.
_THREAD_ENV = {k: "1" for k in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")}


class RewardProcessError(RuntimeError):
    """The reward process could not start (a function fails to import, or start-up timed out)."""


class SampleFailed(Exception):
    """One sample could not be scored: the reward raised, ran past its limit or killed the process."""


def _write_frame(fd: int, obj: Any) -> None:
    body = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    data = memoryview(_HEADER.pack(len(body)) + body)
    while data:
        data = data[os.write(fd, data):]


def _read_exact(fd: int, n: int, deadline: Optional[float]) -> Optional[bytes]:
    """``n`` bytes from ``fd``; None at end of file; TimeoutError past ``deadline``."""
    chunks, got = [], 0
    while got < n:
        if deadline is not None:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([fd], [], [], left)[0]:
                raise TimeoutError
        chunk = os.read(fd, n - got)
        if not chunk:
            return None
        chunks.append(chunk)
        got += len(chunk)
    return b"".join(chunks)


def _read_frame(fd: int, deadline: Optional[float] = None) -> Any:
    header = _read_exact(fd, _HEADER.size, deadline)
    if header is None:
        raise EOFError
    body = _read_exact(fd, _HEADER.unpack(header)[0], deadline)
    if body is None:
        raise EOFError
    return pickle.loads(body)


class RewardProcess:
    """One child process holding the loaded reward functions."""

    def __init__(self, functions: tuple[str, ...], memory_limit_bytes: Optional[int], startup_timeout_s: float):
        self.functions = functions
        self._tmp = tempfile.TemporaryDirectory(prefix=_FOLDER_PREFIX)
        # The parent's import path, absolute, so the child imports the same modules from its own folder.
        path = [os.path.abspath(p) if p else os.getcwd() for p in sys.path]
        env = {**os.environ, **_THREAD_ENV, "PYTHONPATH": os.pathsep.join(path)}
        self._output = os.path.join(self._tmp.name, _OUTPUT_FILE)
        with open(self._output, "ab") as output:  # O_APPEND: the parent may empty it while the child writes
            self.proc = subprocess.Popen([sys.executable, "-c", _CHILD], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                         stderr=output, cwd=self._tmp.name, env=env, bufsize=0, close_fds=True)
        try:
            _write_frame(self.proc.stdin.fileno(), (functions, memory_limit_bytes))
            kind, detail = _read_frame(self.proc.stdout.fileno(), time.monotonic() + startup_timeout_s)
        except TimeoutError:
            self.close()
            raise RewardProcessError(f"reward process did not load {', '.join(functions)} within "
                                     f"{startup_timeout_s:.0f} s") from None
        except (EOFError, OSError):
            self.proc.wait()
            said = self._output_tail(400).strip().splitlines()
            self.close()
            raise RewardProcessError(f"reward process exited while loading {', '.join(functions)} (memory limit "
                                     f"{memory_limit_bytes} bytes too low?)"
                                     + (f"; its last output: {said[-1]}" if said else "")) from None
        if kind != "ready":
            self.close()
            raise RewardProcessError(f"reward process cannot load {', '.join(functions)}: {detail}")

    @property
    def alive(self) -> bool:
        return self.proc.poll() is None

    def score_many(self, samples: list[tuple[str, str, dict[str, Any]]], timeout_s: float
                   ) -> list[list[float | str] | SampleFailed]:
        """Scores of ``samples`` (prompt, completion, fields), sent in one message and answered one
        by one, each within ``timeout_s`` of the answer before it: per sample, each function's value
        or, where it raised, "function: ExceptionType: message". A sample that runs past its
        limit or kills the child ends the list there: its entry is a SampleFailed, the child is
        stopped, and the samples after it are not in the result (score them on a fresh process)."""
        out: list[list[float | str] | SampleFailed] = []
        try:
            _write_frame(self.proc.stdin.fileno(), samples)
            for _ in samples:
                kind, detail = _read_frame(self.proc.stdout.fileno(), time.monotonic() + timeout_s)
                out.append(detail if kind == "ok" else SampleFailed(detail))
        except TimeoutError:
            self.close()
            out.append(SampleFailed(f"reward ran past {timeout_s} s; its process was killed"))
        except (EOFError, OSError):
            code = self.proc.poll()
            self.close()
            out.append(SampleFailed(f"reward process died (exit code {code})"))
        return out

    def take_output(self, limit: int = OUTPUT_LOG_BYTES) -> tuple[str, int]:
        """(the first ``limit`` bytes the functions printed since the last call, as text; how many
        bytes they printed in all), and the file emptied."""
        try:
            with open(self._output, "rb+") as f:
                head = f.read(limit)
                total = f.seek(0, os.SEEK_END)
                f.truncate(0)
        except OSError:  # the child removed its folder (it is gone)
            return "", 0
        return head.decode("utf-8", errors="replace"), total

    def _output_tail(self, limit: int) -> str:
        try:
            with open(self._output, "rb") as f:
                f.seek(max(0, f.seek(0, os.SEEK_END) - limit))
                return f.read().decode("utf-8", errors="replace")
        except OSError:
            return ""

    def log_output(self) -> None:
        """Log what the functions printed since the last call, at most :data:`OUTPUT_LOG_BYTES`."""
        text, total = self.take_output()
        if total:
            more = f" ({total - len(text.encode())} more bytes not shown)" if total > OUTPUT_LOG_BYTES else ""
            log.warning("reward output of %s%s:\n%s", ", ".join(self.functions), more, text.rstrip())

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        self.log_output()  # what it printed before it was stopped, before its folder goes
        for stream in (self.proc.stdin, self.proc.stdout):
            if stream is not None:
                stream.close()
        self._tmp.cleanup()


# One process per (functions, memory limit) in each scoring process, reused across calls.
_PROCESSES: dict[tuple[tuple[str, ...], Optional[int]], RewardProcess] = {}


def reward_process(functions: tuple[str, ...], memory_limit_bytes: Optional[int],
                   startup_timeout_s: float) -> RewardProcess:
    """The live process for these functions, started (again) if it is missing or dead."""
    key = (functions, memory_limit_bytes)
    held = _PROCESSES.get(key)
    if held is None or not held.alive:
        if held is not None:
            held.close()
        _PROCESSES[key] = RewardProcess(functions, memory_limit_bytes, startup_timeout_s)
    return _PROCESSES[key]


@atexit.register
def close_reward_processes() -> None:
    """Stop every reward process this process started."""
    while _PROCESSES:
        _PROCESSES.popitem()[1].close()


def _child_main() -> None:
    """The child's process: serve the parent (:func:`_serve`), then, however that ends short of a
    SIGKILL (stdin closed or the answer pipe broken, start-up included: the parent died without its
    clean-up), remove the working folder the parent started it in."""
    folder = os.getcwd()
    ours = os.path.basename(folder).startswith(_FOLDER_PREFIX)

    def parent_gone(signum, frame) -> None:
        if ours:
            shutil.rmtree(folder, ignore_errors=True)
        os._exit(0)

    signal.signal(signal.SIGTERM, parent_gone)
    if sys.platform.startswith("linux"):  # SIGTERM when the parent goes, busy or not
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    try:
        _serve()
    finally:
        if ours:
            shutil.rmtree(folder, ignore_errors=True)


def _serve() -> None:
    """Load the functions under the memory limit, then score until stdin closes."""
    import resource

    from stages.reward import accepted_fields, resolve_reward

    out_fd, in_fd = os.dup(1), os.dup(0)
    os.dup2(2, 1)  # print() in a reward goes to the output file (stderr), not into the channel
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    sys.stdout = sys.stderr
    functions, memory_limit_bytes = _read_frame(in_fd)
    if memory_limit_bytes is not None:
        resource.setrlimit(resource.RLIMIT_AS, (memory_limit_bytes, memory_limit_bytes))
    try:
        loaded = [(fn, accepted_fields(fn)) for fn in map(resolve_reward, functions)]
    except Exception as exc:
        _write_frame(out_fd, ("error", f"{type(exc).__name__}: {exc}"))
        return
    _write_frame(out_fd, ("ready", None))
    while True:
        try:
            samples = _read_frame(in_fd)
        except EOFError:
            return
        for prompt, completion, fields in samples:  # one answer per sample, as soon as it is scored
            values: list[float | str] = []  # each function's value, or why it failed
            for name, (fn, accepted) in zip(functions, loaded):
                kwargs = fields if accepted is None else {k: v for k, v in fields.items() if k in accepted}
                try:
                    values.append(float(fn(prompt=prompt, completion=completion, **kwargs)))
                except BaseException as exc:  # MemoryError, SystemExit from user code: a failed sample
                    values.append(f"{name}: {type(exc).__name__}: {str(exc)[:300]}")
            _write_frame(out_fd, ("ok", values))
