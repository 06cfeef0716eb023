"""The shipped word-problem dataset: reproducible from its generator, answers right, loadable, and
scored by math_answer; the example config's dataset section is valid."""

from __future__ import annotations

import ast
import json
import re
from pathlib import Path

import pytest
import yaml

from stages.data import DatasetConfig, open_prompt_source
from stages.data.make_word_problems import make_word_problems, write_word_problems
from stages.reward import check_reward_functions, get_reward

ROOT = Path(__file__).resolve().parents[2]
DATA = ROOT / "data" / "word_problems.jsonl"
CONFIG = ROOT / "configs" / "word-problems.yaml"


def test_committed_file_is_what_the_generator_writes(tmp_path):
    fresh = write_word_problems(tmp_path / "w.jsonl", num=400, seed=0)
    assert fresh.read_bytes() == DATA.read_bytes()
    assert DATA.stat().st_size < 200_000
    assert make_word_problems(20, seed=1) != make_word_problems(20, seed=0)


def test_first_problems_worked_by_hand():
    first = [json.loads(line) for line in DATA.read_text().splitlines()[:3]]
    assert first[0]["prompt"].startswith("Mina has 4 coins and buys 6 packs with 10 coins in each. Then Mina "
                                         "gives away 32 coins.")
    assert first[0]["answer"] == "32"  # 4 + 60 - 32
    assert "cards for $7 each. Mina buys 9 of them and pays with a $100 bill" in first[1]["prompt"]
    assert first[1]["answer"] == "37"  # 100 - 63
    assert "at 120 km per hour for 2 hours, then at 80 km per hour for 2 hours" in first[2]["prompt"]
    assert first[2]["answer"] == "400"  # 240 + 160


def _value(node: ast.AST) -> int:
    """Integer arithmetic over + - * // and parentheses, evaluated here independently of the generator."""
    if isinstance(node, ast.Expression):
        return _value(node.body)
    if isinstance(node, ast.Constant) and isinstance(node.value, int):
        return node.value
    ops = {ast.Add: int.__add__, ast.Sub: int.__sub__, ast.Mult: int.__mul__, ast.FloorDiv: int.__floordiv__}
    assert isinstance(node, ast.BinOp) and type(node.op) in ops, ast.dump(node)
    return ops[type(node.op)](_value(node.left), _value(node.right))


def test_every_answer_is_a_positive_integer_from_the_prompts_numbers():
    records = [json.loads(line) for line in DATA.read_text().splitlines()]
    assert len(records) == 400 and len({r["prompt"] for r in records}) == 400
    for r in records:
        assert r["answer"] == str(_value(ast.parse(r["expression"], mode="eval")))
        assert int(r["answer"]) > 0 and r["num_steps"] >= 2
        # Every operand is a number the prompt states ("// 100" of a percentage aside).
        operands = set(re.findall(r"\d+", r["expression"].replace("// 100", "") if "%" in r["prompt"]
                                  else r["expression"]))
        assert operands <= set(re.findall(r"\d+", r["prompt"])), r


def test_dataset_loads_and_math_answer_scores_it():
    cfg_yaml = yaml.safe_load(CONFIG.read_text())
    section = {**cfg_yaml["dataset"], "path": str(ROOT / cfg_yaml["dataset"]["path"])}
    cfg = DatasetConfig(**section)

    class Chars:  # a stand-in tokenizer: one token per character, plus BOS
        def encode(self, text):
            return [ord(c) for c in text]

        def decode(self, ids):
            return "".join(map(chr, ids))

        def encode_prompt(self, text):
            return [0] + self.encode(text)

    src = open_prompt_source(DatasetConfig(**{**section, "max_prompt_tokens": None}), Chars(),
                             cfg_yaml["task"]["prompts_per_step"])
    assert src.num_steps == 75  # 3 epochs * 400 / 16, as the config's comment says
    assert src.prompt_width == 1 + 196  # BOS + the longest prompt's characters
    check_reward_functions(cfg_yaml["reward"]["functions"], fields=["answer", "expression", "num_steps"])
    fn = get_reward("math_answer")
    for r in src.records(0):
        kwargs = r.reward_kwargs()
        assert fn(prompt=r.prompt, completion=f"So the answer is \\boxed{{{r.answer}}}.", answer=kwargs["answer"]) == 1
        assert fn(prompt=r.prompt, completion=f"\\boxed{{{int(r.answer) + 1}}}", answer=r.answer) == 0
    assert cfg.max_prompt_tokens == 128


@pytest.mark.parametrize("key", ["kind", "path", "answer_field", "epochs", "max_prompt_tokens", "overflow"])
def test_config_sets_each_dataset_key(key):
    assert key in yaml.safe_load(CONFIG.read_text())["dataset"]
