"""The arithmetic task's files: held-out prompts share no operand pair with training, in either order."""

from __future__ import annotations

from pathlib import Path

from stages.data.make_arithmetic import make_arithmetic, write_arithmetic


def test_held_out_pairs_are_never_trained_on_in_either_order():
    train, test = make_arithmetic(2048, 256, seed=0)
    trained = {frozenset((r["a"], r["b"])) for r in train}
    assert len(train) == 2048 and 150 < len(test) <= 256
    assert not any(frozenset((r["a"], r["b"])) in trained for r in test)
    assert all(r["answer"] == str(r["a"] + r["b"]) and f"{r['a']} + {r['b']}?" in r["prompt"] for r in train + test)


def test_the_shipped_files_are_what_the_generator_writes(tmp_path):
    for written in write_arithmetic(tmp_path, 2048, 256, seed=0):
        assert written.read_bytes() == (Path("data") / written.name).read_bytes()
