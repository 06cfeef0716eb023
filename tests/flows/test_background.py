"""The loop's background process (flows/background.py): calls in order in a low-priority child,
errors and a dead or stuck child reported to the caller, never a hang."""

from __future__ import annotations

import os
import sys
import time

import pytest

from flows.background import BackgroundError, BackgroundProcess

_SEEN: list[int] = []  # in the child: what earlier calls left


def remember(i: int) -> list[int]:
    time.sleep(0.02)
    _SEEN.append(i)
    return list(_SEEN)


def fail(message: str) -> None:
    raise RuntimeError(message)


def niceness_and_pid() -> tuple[int, int]:
    return os.getpriority(os.PRIO_PROCESS, 0), os.getpid()


def exit_now(code: int) -> None:
    os._exit(code)


def unpicklable():
    return lambda: None


def test_calls_run_in_order_in_one_child_and_keep_its_state():
    own = os.getpriority(os.PRIO_PROCESS, 0)
    writer = BackgroundProcess(max_pending=2)
    try:
        futures = [writer.submit(remember, i) for i in range(5)]
        assert len(writer._pending) <= 2  # a further submit waited for the oldest
        writer.drain()
        assert [f.result() for f in futures] == [[0], [0, 1], [0, 1, 2], [0, 1, 2, 3], [0, 1, 2, 3, 4]]
        assert _SEEN == []  # the calls ran in the child, not here
        future = writer.submit(niceness_and_pid)
        writer.drain()
        niceness, pid = future.result()
        assert pid == writer.pid != os.getpid()
        if sys.platform == "linux":
            assert niceness == 19  # raising one's own niceness needs no privilege
        assert os.getpriority(os.PRIO_PROCESS, 0) == own  # the caller's is untouched
    finally:
        writer.close()


def test_a_failed_call_is_raised_to_the_caller_with_the_childs_traceback():
    writer = BackgroundProcess()
    try:
        writer.submit(fail, "sqlite store is read-only")
        after = writer.submit(remember, 7)  # still runs: the error reaches the loop, the child goes on
        with pytest.raises(RuntimeError, match="read-only") as info:
            writer.drain()
        assert any("in the background process" in note and "fail" in note for note in info.value.__notes__)
        writer.drain()
        assert after.result()[-1] == 7
        writer.submit(unpicklable)
        with pytest.raises(BackgroundError, match="could not be sent back"):
            writer.drain()
        writer.submit(fail, "queued at close")
    finally:
        writer.close()  # a failing run: a queued error is logged, not raised again
    with pytest.raises(BackgroundError, match="closed"):
        writer.submit(remember, 1)
    with pytest.raises(ValueError, match="max_pending"):
        BackgroundProcess(max_pending=0)


def test_a_child_that_exits_or_hangs_fails_the_wait_instead_of_blocking_it():
    writer = BackgroundProcess()
    try:
        writer.submit(exit_now, 3)
        writer.submit(remember, 1)
        with pytest.raises(BackgroundError, match=r"exited \(code 3\) with 2 call\(s\) unanswered"):
            writer.drain()
    finally:
        writer.close()
    writer = BackgroundProcess(timeout_s=0.5)
    try:
        writer.submit(time.sleep, 30)
        start = time.monotonic()
        with pytest.raises(BackgroundError, match="call sleep did not answer within 0.5 s"):
            writer.drain()
        assert time.monotonic() - start < 5
    finally:
        start = time.monotonic()
        writer.close()  # the stuck child is stopped, not waited for
        assert time.monotonic() - start < 3
