"""Reward scoring: the registry, import paths, signature checks, and faults in the isolated reward
process that must fail one sample, never the call."""

from __future__ import annotations

import math
import os
import time

import numpy as np
import pytest

from stages.reward import (REWARDS, RewardFunctionError, RewardProcessError, check_reward_functions, get_reward,
                           resolve_reward, score_samples)
from stages.reward.isolated import close_reward_processes

# Reward functions the child process imports by path: this module is importable there under the
# same name, because the child gets the parent's sys.path.
HERE = __name__


def plain(prompt: str, completion: str) -> float:
    return float(len(completion))


def with_answer(prompt: str, completion: str, answer: str, level: int = 0) -> float:
    return 10.0 * (completion == answer) + level


def faulty(prompt: str, completion: str, **fields) -> float:
    """Misbehaves on command: the completion says how."""
    if completion == "sleep":
        time.sleep(60)
    elif completion == "exit":
        os._exit(3)
    elif completion == "segfault":
        import ctypes
        ctypes.string_at(0)
    elif completion == "hog":
        block = bytearray(1 << 30)  # 1 GiB, over the test's 256 MiB limit
        return float(len(block))
    elif completion == "raise":
        raise RuntimeError("boom")
    elif completion == "nan":
        return math.nan
    elif completion == "huge":
        return 1e300  # finite in float64, inf in the float32 reward column
    elif completion == "print":
        print("a reward that prints must not corrupt the channel")
    return 1.0 + len(fields)


not_callable = 42


def positional_only(prompt, completion, /) -> float:
    return 0.0


def no_completion(prompt: str, text: str) -> float:
    return 0.0


@pytest.fixture(autouse=True)
def _stop_processes():
    yield
    close_reward_processes()


def test_exact_match_checks_the_sum_or_the_answer():
    fn = get_reward("exact_match")
    assert fn("12+34=", "46") == 1.0
    assert fn("12+34=", "45") == 0.0
    assert fn("99+1=", "100") == 1.0
    assert fn(prompt="How many?", completion=" 7 ", answer="7") == 1.0


def test_digit_match_gives_partial_credit():
    fn = get_reward("digit_match")
    assert fn("12+34=", "46") == 1.0
    assert fn("12+34=", "41") == pytest.approx(0.5)
    # Right-aligned "1234" vs "124": 4 = 4, 3 != 2, 2 != 1 -> 1 of 3, and one extra character.
    assert fn("x", "1234", answer="124") == pytest.approx(1 / 3 - 0.1)


def test_names_resolve_by_registry_and_import_path():
    assert resolve_reward("exact_match") is REWARDS["exact_match"]
    assert resolve_reward(f"{HERE}:plain") is plain
    assert resolve_reward("os.path:join") is os.path.join


@pytest.mark.parametrize("name, message", [
    ("no_such_reward", r"reward.functions\[0\]='no_such_reward' is not a registered reward \(known: .*exact_match"),
    ("no_such_pkg.mod:fn", r"reward.functions\[0\]='no_such_pkg.mod:fn': module 'no_such_pkg.mod' not found"),
    (f"{HERE}:missing", r"has no attribute 'missing'"),
    (f"{HERE}:not_callable", r"not_callable is a int, not callable"),
    (f"{HERE}:no_completion", r"cannot take completion="),
    (f"{HERE}:positional_only", r"cannot take prompt="),
])
def test_check_reward_functions_fails_in_one_line(name, message):
    with pytest.raises(RewardFunctionError, match=message) as info:
        check_reward_functions([name])
    assert "\n" not in str(info.value)


def test_check_reward_functions_knows_the_data_fields():
    check_reward_functions(["exact_match", f"{HERE}:plain", f"{HERE}:faulty", "math_answer"])
    check_reward_functions([f"{HERE}:with_answer"], fields=["answer"])
    with pytest.raises(RewardFunctionError, match=r"requires answer, which the data does not provide"):
        check_reward_functions([f"{HERE}:with_answer"], fields=[])


def test_fields_reach_the_functions_that_accept_them():
    scored = score_samples(["p", "p", "p"], ["7", "8", "ab"], [f"{HERE}:with_answer", f"{HERE}:plain"],
                           timeout_s=10.0, fields=[{"answer": "7", "level": 2}, {"answer": "7", "level": 0},
                                                   {"answer": "ab", "other": "ignored"}])
    np.testing.assert_array_equal(scored.reward, [10 + 2 + 1, 0 + 0 + 1, 10 + 0 + 2])
    assert not scored.failed.any()


def test_every_fault_fails_only_its_sample_within_the_time_limit():
    kinds = ["ok", "sleep", "ok", "exit", "segfault", "hog", "raise", "nan", "huge", "print", "ok"]
    timeout_s = 1.0
    t0 = time.monotonic()
    scored = score_samples(["p"] * len(kinds), kinds, [f"{HERE}:faulty"], timeout_s=timeout_s,
                           fields=[{"answer": "1"}] * len(kinds), memory_limit_bytes=256 << 20)
    elapsed = time.monotonic() - t0
    expect_failed = [k not in ("ok", "print") for k in kinds]
    np.testing.assert_array_equal(scored.failed, expect_failed)
    np.testing.assert_array_equal(scored.reward, np.where(expect_failed, 0.0, 2.0))  # 1 + one field
    # One sleep killed at the limit, plus restarting the process after the sleep, exit and segfault.
    assert elapsed < timeout_s + 15.0, elapsed


def test_a_function_that_cannot_load_raises_once():
    with pytest.raises(RewardProcessError, match="cannot load .*no_such_reward"):
        score_samples(["p"], ["c"], ["no_such_reward"], timeout_s=1.0)


def _score_in_child(queue) -> None:
    try:
        scored = score_samples(["p", "p"], ["ok", "exit"], [f"{HERE}:faulty"], timeout_s=5.0)
        queue.put((scored.reward.tolist(), scored.failed.tolist()))
    finally:
        close_reward_processes()


def test_scoring_works_inside_a_daemonic_process():
    """Dask's Nanny runs workers as daemonic processes, which multiprocessing forbids to have
    children; the reward process is started with subprocess, so scoring works there too."""
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    proc = ctx.Process(target=_score_in_child, args=(queue,), daemon=True)
    proc.start()
    try:
        assert queue.get(timeout=60) == ([1.0, 0.0], [False, True])  # no fields: 1 + 0
    finally:
        proc.join(timeout=10)


def _hold_reward_process(queue) -> None:
    from stages.reward.isolated import reward_process

    proc = reward_process((f"{HERE}:plain",), None, 60.0)
    queue.put((proc._tmp.name, proc.proc.pid))
    time.sleep(600)  # killed by the test


def test_a_killed_parent_leaves_no_reward_folder():
    """A worker lost to SIGKILL runs no clean-up: its reward process removes its own folder once
    the parent's end of its stdin closes, and exits."""
    import multiprocessing as mp
    import signal

    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    parent = ctx.Process(target=_hold_reward_process, args=(queue,), daemon=True)
    parent.start()
    folder, child = queue.get(timeout=60)
    assert os.path.isdir(folder)
    os.kill(parent.pid, signal.SIGKILL)
    parent.join(timeout=10)
    deadline = time.monotonic() + 20
    while (os.path.exists(folder) or _alive(child)) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not os.path.exists(folder), "the reward process left its folder behind"
    assert not _alive(child), "the reward process outlived its parent"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A child of a killed parent is re-parented and reaped by init; a zombie counts as gone.
    with open(f"/proc/{pid}/stat") as fh:
        return fh.read().split(")")[-1].split()[0] != "Z"


@pytest.mark.parametrize("prefixed", [True, False])
def test_a_parent_gone_during_start_up_leaves_no_reward_folder(tmp_path, prefixed):
    """The parent gone before its first message (the child's imports take a while): the child
    still removes the folder it was started in, and only a folder of the reward process's own."""
    import subprocess
    import sys
    import tempfile

    from stages.reward import isolated

    folder = tempfile.mkdtemp(prefix=isolated._FOLDER_PREFIX if prefixed else "other-", dir=tmp_path)
    path = os.pathsep.join(os.path.abspath(p) if p else os.getcwd() for p in sys.path)
    child = subprocess.Popen([sys.executable, "-c", isolated._CHILD], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             stderr=subprocess.DEVNULL, cwd=folder, env={**os.environ, "PYTHONPATH": path})
    child.stdin.close()
    child.wait(timeout=60)
    child.stdout.close()
    assert os.path.exists(folder) is not prefixed


def test_last_number_takes_the_final_number_only():
    from stages.reward import resolve_reward

    score = resolve_reward("last_number")
    assert score(prompt="What is 4 * 8?", completion="4 * 8 = 32", answer="32") == 1.0
    assert score(prompt="", completion="The sum is 1,081.", answer="1081") == 1.0
    assert score(prompt="", completion="81.0", answer="81") == 1.0
    # An expression restated at the end is no answer (math_answer would evaluate it to 32).
    assert score(prompt="What is 4 * 8?", completion="So, 4 * 8 =", answer="32") == 0.0
    assert score(prompt="", completion="no idea", answer="81") == 0.0
    with pytest.raises(ValueError, match="answer_field"):
        score(prompt="", completion="3")


def test_the_first_failure_is_told_with_its_function():
    from stages.reward import score_samples

    raising = "tests.flows.nonfinite_rewards:raising_reward"
    scored = score_samples(["1+1="] * 3, ["2", "3", "4"], ["exact_match", raising], 5.0)
    assert scored.failed.all() and scored.first_error == f"{raising}: RuntimeError: the grader is broken"
    nan = score_samples(["1+1="], ["2"], ["tests.flows.nonfinite_rewards:nan_reward"], 5.0)
    assert nan.first_error.endswith("returned nan, not a finite number")
    assert score_samples(["1+1="], ["2"], ["exact_match"], 5.0).first_error == ""


def loud(prompt: str, completion: str) -> float:
    """Prints ``completion`` times 64 KiB of x, then scores 0.5."""
    print("x" * (int(completion) << 16))
    return 0.5


def test_each_function_is_scored_and_its_failures_counted_on_its_own():
    from stages.reward import reward_labels

    functions = ["exact_match", f"{HERE}:faulty", f"{HERE}:plain"]
    scored = score_samples(["1+1="] * 4, ["2", "raise", "nan", "sleep"], functions, timeout_s=1.0,
                           fields=[{"answer": "2"}] * 4)
    assert reward_labels(functions) == ["exact_match", "faulty", "plain"]
    np.testing.assert_array_equal(scored.failed, [False, True, True, True])
    # faulty raised or returned NaN: exact_match and plain still scored those samples; the sleep
    # killed the process, so no function's value is known for it.
    np.testing.assert_array_equal(scored.by_function[:3], [[1.0, 2.0, 1.0], [0.0, math.nan, 5.0],
                                                           [0.0, math.nan, 3.0]])
    assert np.isnan(scored.by_function[3]).all()
    stats = scored.function_metrics()
    assert stats["exact_match"] == {"sum": 1.0, "scored": 3, "failed": 1,
                                    "first_error": "reward ran past 1.0 s; its process was killed"}
    assert stats["faulty"]["failed"] == 3 and stats["faulty"]["scored"] == 1
    assert stats["faulty"]["first_error"] == f"{HERE}:faulty: RuntimeError: boom"
    assert stats["plain"]["sum"] == 9.0 and stats["plain"]["failed"] == 1
    assert scored.first_error == f"{HERE}:faulty: RuntimeError: boom"
    assert reward_labels(["a.x:score", "b.y:score", "z"]) == ["a.x.score", "b.y.score", "z"]


def test_a_reward_that_prints_a_lot_is_logged_capped(caplog):
    from stages.reward.isolated import OUTPUT_LOG_BYTES

    with caplog.at_level("WARNING", logger="stages.reward.isolated"):
        scored = score_samples(["p"] * 3, ["4", "4", "4"], [f"{HERE}:loud"], timeout_s=10.0)
    assert not scored.failed.any() and (scored.reward == 0.5).all()
    said = [r.getMessage() for r in caplog.records if "reward output" in r.getMessage()]
    assert len(said) == 1, said  # one message for the call, not 768 KiB of x
    assert len(said[0]) < OUTPUT_LOG_BYTES + 200 and f"({3 * (4 << 16) + 3 - OUTPUT_LOG_BYTES} more bytes" in said[0]


def _hold_hanging_reward(queue) -> None:
    from stages.reward.isolated import reward_process

    proc = reward_process((f"{HERE}:faulty",), None, 60.0)
    queue.put((proc._tmp.name, proc.proc.pid))
    proc.score_many([("p", "sleep", {})], timeout_s=600.0)  # the parent is killed in here


def test_a_reward_that_hangs_dies_with_its_parent():
    """A child busy in a reward reads no stdin: it goes on the parent's death signal, folder removed."""
    import multiprocessing as mp
    import signal

    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    parent = ctx.Process(target=_hold_hanging_reward, args=(queue,), daemon=True)
    parent.start()
    folder, child = queue.get(timeout=60)
    time.sleep(1.0)  # the child is in time.sleep(60) now
    os.kill(parent.pid, signal.SIGKILL)
    parent.join(timeout=10)
    deadline = time.monotonic() + 20
    while (os.path.exists(folder) or _alive(child)) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive(child), "a hanging reward process outlived its parent"
    assert not os.path.exists(folder)
