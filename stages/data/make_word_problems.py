"""Generate the shipped example dataset: multi-step arithmetic word problems with integer answers.

    python -m stages.data.make_word_problems --out data/word_problems.jsonl --num 400 --seed 0

Each record has ``prompt`` (the problem and an instruction to box the answer), ``answer`` (an
integer, as text), ``expression`` (the arithmetic that gives it, with the prompt's numbers in the
order they appear) and ``num_steps`` (operations in it). The output is a pure function of (num,
seed): the same arguments write the same bytes.
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path
from typing import Callable

__all__ = ["make_word_problems", "write_word_problems", "main"]

_NAMES = ["Ava", "Ben", "Chloe", "Dev", "Elena", "Farid", "Grace", "Hiro", "Ines", "Jonas", "Kemi", "Luca",
          "Mina", "Noah", "Olga", "Priya", "Quinn", "Rosa", "Sami", "Tara"]
_ITEMS = ["apple", "marble", "sticker", "pencil", "card", "shell", "coin", "stamp", "button", "bead"]
_INSTRUCTION = " Give the final answer as a number in \\boxed{}."

Problem = tuple[str, str]  # (text, expression)


def _packs(r: random.Random) -> Problem:
    name, item = r.choice(_NAMES), r.choice(_ITEMS)
    a, b, c = r.randint(2, 40), r.randint(2, 9), r.randint(2, 12)
    d = r.randint(1, a + b * c - 1)
    return (f"{name} has {a} {item}s and buys {b} packs with {c} {item}s in each. Then {name} gives away {d} "
            f"{item}s. How many {item}s does {name} have now?", f"{a} + {b} * {c} - {d}")


def _change(r: random.Random) -> Problem:
    name, item = r.choice(_NAMES), r.choice(_ITEMS)
    n, p = r.randint(2, 9), r.randint(2, 15)
    bill = r.choice([b for b in (20, 50, 100, 200) if b > n * p] or [500])
    return (f"A shop sells {item}s for ${p} each. {name} buys {n} of them and pays with a ${bill} bill. "
            f"How many dollars of change does {name} get?", f"{bill} - {n} * {p}")


def _train(r: random.Random) -> Problem:
    s, h, s2, h2 = r.randint(4, 12) * 10, r.randint(1, 5), r.randint(4, 12) * 10, r.randint(1, 5)
    return (f"A train travels at {s} km per hour for {h} hours, then at {s2} km per hour for {h2} hours. "
            "How many kilometres does it travel in total?", f"{s} * {h} + {s2} * {h2}")


def _pages(r: random.Random) -> Problem:
    name = r.choice(_NAMES)
    a, d, b, e = r.randint(5, 30), r.randint(2, 7), r.randint(5, 30), r.randint(2, 7)
    total = a * d + b * e + r.randint(1, 200)
    return (f"A book has {total} pages. {name} reads {a} pages a day for {d} days, then {b} pages a day for "
            f"{e} days. How many pages are left to read?", f"{total} - ({a} * {d} + {b} * {e})")


def _chairs(r: random.Random) -> Problem:
    rooms, each = r.randint(2, 8), r.randint(3, 20)
    cols = r.randint(4, 12)
    rows = -(-(rooms * each) // cols) + r.randint(0, 3)  # enough chairs to remove some
    broken = rows * cols - rooms * each
    return (f"A hall has {rows} rows of {cols} chairs. {broken} chairs are broken and removed, and the rest "
            f"are shared equally among {rooms} rooms. How many chairs does each room get?",
            f"({rows} * {cols} - {broken}) // {rooms}")


def _wages(r: random.Random) -> Problem:
    name = r.choice(_NAMES)
    w, h, n = r.randint(8, 25), r.randint(5, 30), r.randint(2, 6)
    spent = r.randint(1, w * h * n - 1)
    return (f"{name} earns ${w} per hour and works {h} hours a week. After {n} weeks {name} has spent ${spent}. "
            f"How many dollars does {name} have left?", f"{w} * {h} * {n} - {spent}")


def _bakery(r: random.Random) -> Problem:
    # per is a multiple of 4, so per * pct / 100 is whole for pct in 25, 50, 75: no fractional muffins.
    trays, per, sold_pct = r.randint(3, 12), r.choice([4, 8, 12, 20, 24]), r.choice([25, 50, 75])
    return (f"A bakery bakes {trays} trays of {per} muffins. It sells {sold_pct}% of them in the morning and "
            f"3 more in the afternoon. How many muffins are left?",
            f"{trays} * {per} - {trays} * {per} * {sold_pct} // 100 - 3")


_TEMPLATES: tuple[Callable[[random.Random], Problem], ...] = (_packs, _change, _train, _pages, _chairs, _wages,
                                                              _bakery)


def _evaluate(expression: str) -> int:
    """Integer value of an expression of non-negative integers, + - * // and parentheses."""
    allowed = set("0123456789+-*/() ")
    if not set(expression) <= allowed:
        raise ValueError(f"unexpected character in {expression!r}")
    return int(eval(expression, {"__builtins__": {}}))  # only digits and operators reach here


def make_word_problems(num: int, seed: int) -> list[dict]:
    """``num`` distinct problems with positive integer answers, deterministic in (num, seed)."""
    r = random.Random(seed)
    seen, out = set(), []
    while len(out) < num:
        template = _TEMPLATES[len(out) % len(_TEMPLATES)]
        text, expression = template(r)
        value = _evaluate(expression)
        if value <= 0 or text in seen:  # every answer positive, every problem distinct: redraw otherwise
            continue
        seen.add(text)
        num_steps = sum(expression.count(op) for op in ("+", " - ", "*", "//"))
        out.append({"prompt": text + _INSTRUCTION, "answer": str(value), "expression": expression,
                    "num_steps": num_steps})
    return out


def write_word_problems(path: str | Path, num: int, seed: int) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(p, ensure_ascii=False) + "\n" for p in make_word_problems(num, seed)))
    return path


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="data/word_problems.jsonl")
    parser.add_argument("--num", type=int, default=400)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    path = write_word_problems(args.out, args.num, args.seed)
    print(f"wrote {args.num} problems to {path} ({path.stat().st_size} bytes)")


if __name__ == "__main__":
    main()
