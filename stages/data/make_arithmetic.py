"""Generate the real-model task: two-digit addition in words a small instruct model half-knows,
split into a training file and a held-out file that share no operand pair.

    python -m stages.data.make_arithmetic --out-dir data --num-train 2048 --num-test 256 --seed 0

Every ordered pair (a, b) with 10 <= a, b <= 99 (8,100 of them) is shuffled by ``seed``; the next
``num_train`` after the first ``num_test`` go to ``arithmetic_train.jsonl``, and of the first
``num_test`` those whose swapped pair (b, a) is not a training pair go to ``arithmetic_test.jsonl``:
no held-out prompt is a training prompt read the other way round (the sums themselves, 20 to 198,
all occur in training).
A record is ``{"prompt": "What is 23 + 58? Answer with only the number.", "answer": "81", "a": 23,
"b": 58}``. SmolLM2-135M-Instruct answers 17% of them right greedily within 48 tokens
(benchmarks/base_accuracy.py): it knows the sums but talks around them and runs out of tokens, so
GRPO has a signal on most prompts. The output is a pure function of the arguments.
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

__all__ = ["INSTRUCTION", "make_arithmetic", "write_arithmetic", "main"]

INSTRUCTION = " Answer with only the number."


def make_arithmetic(num_train: int, num_test: int, seed: int) -> tuple[list[dict], list[dict]]:
    """(train records, held-out records), disjoint in their unordered operand pairs."""
    pairs = [(a, b) for a in range(10, 100) for b in range(10, 100)]
    if num_train + num_test > len(pairs):
        raise ValueError(f"num_train + num_test = {num_train + num_test} exceeds the {len(pairs)} operand pairs")
    random.Random(seed).shuffle(pairs)
    train = pairs[num_test: num_test + num_train]
    seen = {frozenset(p) for p in train}
    test = [p for p in pairs[:num_test] if frozenset(p) not in seen]

    def record(a: int, b: int) -> dict:
        return {"prompt": f"What is {a} + {b}?{INSTRUCTION}", "answer": str(a + b), "a": a, "b": b}

    return [record(*p) for p in train], [record(*p) for p in test]


def write_arithmetic(out_dir: str | Path, num_train: int, num_test: int, seed: int) -> tuple[Path, Path]:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    train, test = make_arithmetic(num_train, num_test, seed)
    paths = out / "arithmetic_train.jsonl", out / "arithmetic_test.jsonl"
    for path, records in zip(paths, (train, test)):
        path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return paths


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out-dir", default="data")
    p.add_argument("--num-train", type=int, default=2048)
    p.add_argument("--num-test", type=int, default=256)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    for path in write_arithmetic(args.out_dir, args.num_train, args.num_test, args.seed):
        print(path)


if __name__ == "__main__":
    main()
