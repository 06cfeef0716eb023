"""Prompt sources: reading files, one-line errors, step order over epochs, prompt width, overflow."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from stages.data import DatasetConfig, DatasetError, open_prompt_source, read_records
from stages.policy.tokenizer import TextCodec
from stages.tasks.addition import make_tokenizer_json


class CharCodec:
    """One token per character plus a BOS id 0: prompt lengths are worked out by hand."""

    def encode(self, text: str) -> list[int]:
        return [ord(c) for c in text]

    def decode(self, ids: list[int]) -> str:
        return "".join(chr(i) for i in ids if i)

    def encode_prompt(self, text: str) -> list[int]:
        return [0] + self.encode(text)


def write_jsonl(path: Path, rows: list) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def rows(n: int) -> list[dict]:
    return [{"question": f"q{i}" + "x" * (i % 4), "answer": i * 3, "level": i % 2} for i in range(n)]


def source(path: Path, prompts_per_step: int = 4, **kw):
    cfg = DatasetConfig(kind=kw.pop("kind", "jsonl"), path=str(path), prompt_field="question", **kw)
    return open_prompt_source(cfg, CharCodec(), prompts_per_step)


# -- reading and errors --------------------------------------------------------------------------------
def test_jsonl_records_carry_answer_and_extra_fields(tmp_path):
    src = source(write_jsonl(tmp_path / "d.jsonl", rows(3)), prompts_per_step=3, shuffle=False)
    got = src.records(0)
    assert [r.prompt for r in got] == ["q0", "q1x", "q2xx"]
    assert [r.answer for r in got] == ["0", "3", "6"]
    assert got[1].reward_kwargs() == {"answer": "3", "level": 1}
    assert got[2].prompt_ids == (0, ord("q"), ord("2"), ord("x"), ord("x"))
    assert src.prompt_width == 1 + len("q2xx")  # BOS + the longest prompt's characters


@pytest.mark.parametrize("lines, message", [
    ([{"question": "a", "answer": 1}, {"prompt": "b", "answer": 2}], r"d.jsonl:line 2: missing field 'question'"),
    ([{"question": 5, "answer": 1}], r"d.jsonl:line 1: field 'question' is int, not a string"),
    ([{"question": "a"}], r"d.jsonl:line 1: missing field 'answer' \(dataset.answer_field\)"),
    ([{"question": "a", "answer": None}], r"d.jsonl:line 1: field 'answer' is NoneType"),
    (["", "{not json"], r"d.jsonl:line 2: not valid JSON"),
    (["[1, 2]"], r"d.jsonl:line 1: a list, not a JSON object"),
    ([], r"d.jsonl: no records"),
    ([{"question": "a", "answer": 1, "completion": "x"}], r"line 1: field 'completion' clashes"),
])
def test_bad_jsonl_fails_in_one_line_naming_file_line_and_field(tmp_path, lines, message):
    path = write_jsonl(tmp_path / "d.jsonl", lines)
    with pytest.raises(DatasetError, match=message) as info:
        source(path)
    assert "\n" not in str(info.value)


def test_jsonl_that_is_not_utf8_is_refused_naming_the_line(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_bytes(b'{"question": "a", "answer": 1}\n{"question": "caf\xe9", "answer": 2}\n')  # Latin-1
    with pytest.raises(DatasetError, match=r"d.jsonl:line 2: not UTF-8 \(byte 0xe9 at column 18\)") as info:
        source(path)
    assert "\n" not in str(info.value)


def test_a_byte_order_mark_is_read_past(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_bytes(b"\xef\xbb\xbf" + write_jsonl(tmp_path / "plain.jsonl", rows(2)).read_bytes())
    assert [r.prompt for r in source(path, prompts_per_step=2, shuffle=False).records(0)] == ["q0", "q1x"]


def test_prompt_over_the_limit_is_refused_naming_the_line(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", rows(6))
    # "q3xxx" is 5 characters + BOS = 6 tokens, over 5.
    with pytest.raises(DatasetError, match=r"d.jsonl:line 4: field 'question' is 6 tokens, over "
                                           r"dataset.max_prompt_tokens=5"):
        source(path, max_prompt_tokens=5)


def test_truncate_cuts_text_to_fit_and_counts(tmp_path):
    src = source(write_jsonl(tmp_path / "d.jsonl", rows(8)), prompts_per_step=8, shuffle=False,
                 max_prompt_tokens=4, overflow="truncate")
    got = src.records(0)
    assert [r.prompt for r in got] == ["q0", "q1x", "q2x", "q3x", "q4", "q5x", "q6x", "q7x"]
    assert src.num_truncated == 4  # q2xx, q3xxx, q6xx, q7xxx
    assert src.prompt_width == 4


def test_missing_file_and_missing_path(tmp_path):
    with pytest.raises(DatasetError, match=r"nope.jsonl: not found"):
        source(tmp_path / "nope.jsonl")
    with pytest.raises(DatasetError, match=r"dataset.kind=jsonl needs dataset.path"):
        DatasetConfig(kind="jsonl")
    with pytest.raises(DatasetError, match=r"dataset.overflow='cut' is not one of refuse, truncate"):
        DatasetConfig(overflow="cut")
    with pytest.raises(DatasetError, match=r"dataset.path='x' is set but dataset.kind=addition"):
        DatasetConfig(path="x")


def test_parquet_and_hf_give_the_same_records_as_jsonl(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    data = rows(7)
    jsonl = [(r.prompt, r.answer, r.fields) for r in read_records(DatasetConfig(
        kind="jsonl", path=str(write_jsonl(tmp_path / "d.jsonl", data)), prompt_field="question"))]
    pq.write_table(pa.Table.from_pylist(data), tmp_path / "d.parquet")
    parquet = read_records(DatasetConfig(kind="parquet", path=str(tmp_path / "d.parquet"), prompt_field="question"))
    assert [(r.prompt, r.answer, r.fields) for r in parquet] == jsonl
    assert parquet[3].where.endswith("d.parquet row 3")
    datasets = pytest.importorskip("datasets")
    datasets.Dataset.from_list(data).save_to_disk(str(tmp_path / "hf"))
    hf = read_records(DatasetConfig(kind="hf", path=str(tmp_path / "hf"), prompt_field="question"))
    assert [(r.prompt, r.answer, r.fields) for r in hf] == jsonl
    datasets.DatasetDict({"train": datasets.Dataset.from_list(data)}).save_to_disk(str(tmp_path / "dd"))
    with pytest.raises(DatasetError, match=r"dd: holds several splits; set dataset.path to one of .*dd/train"):
        read_records(DatasetConfig(kind="hf", path=str(tmp_path / "dd"), prompt_field="question"))


def test_parquet_missing_column_names_the_columns(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist([{"text": "a", "answer": "1"}]), tmp_path / "d.parquet")
    with pytest.raises(DatasetError, match=r"d.parquet: no column 'question' .*columns: text, answer"):
        source(tmp_path / "d.parquet", kind="parquet")


# -- step order -----------------------------------------------------------------------------------------
def _stream(src, num_steps: int) -> list[int]:
    return [r.index for step in range(num_steps) for r in src.records(step)]


def test_each_epoch_visits_every_record_once_in_a_seeded_order(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", rows(10))
    stream = _stream(source(path, seed=7), 10)  # 40 positions = 4 epochs of 10 (steps straddle epochs)
    epochs = [stream[e * 10:(e + 1) * 10] for e in range(4)]
    assert all(sorted(e) == list(range(10)) for e in epochs)
    assert len({tuple(e) for e in epochs}) == 4  # a fresh order each epoch
    assert stream == _stream(source(path, seed=7), 10)  # deterministic in (seed, step, data)
    assert stream != _stream(source(path, seed=8), 10)
    assert source(path, seed=7).records(6) == source(path, seed=7).records(6)  # no hidden state


def test_unshuffled_stream_is_file_order_repeated(tmp_path):
    src = source(write_jsonl(tmp_path / "d.jsonl", rows(5)), prompts_per_step=3, shuffle=False)
    assert _stream(src, 4) == [0, 1, 2, 3, 4, 0, 1, 2, 3, 4, 0, 1]


def test_epochs_bound_the_steps(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", rows(10))
    src = source(path, epochs=2)
    assert src.num_steps == 5  # floor(2 * 10 / 4)
    src.records(4)
    with pytest.raises(DatasetError, match=r"step 5 is past the data's 5 steps \(dataset.epochs=2\)"):
        src.records(5)
    with pytest.raises(DatasetError, match=r"do not fill one step"):
        source(path, prompts_per_step=11, epochs=1)


# -- the addition task through the same interface -----------------------------------------------------------
@pytest.mark.parametrize("num_digits", [1, 3])
def test_addition_source_matches_the_task(num_digits):
    codec = TextCodec.from_json(make_tokenizer_json())
    src = open_prompt_source(DatasetConfig(num_digits=num_digits, seed=3), codec, prompts_per_step=16)
    assert src.prompt_width == 1 + 2 * num_digits + 2  # "<bos>" + a + "+" + b + "="
    got = src.records(5)
    assert len(got) == 16 and got == src.records(5) and got != src.records(6)
    for r in got:
        a, b = r.prompt[:-1].split("+")
        assert r.answer == str(int(a) + int(b))
        assert r.prompt_ids[0] == codec.bos_id and len(r.prompt_ids) == 1 + len(r.prompt)
        assert max(int(a), int(b)) < 10 ** num_digits
    assert np.mean([len(r.prompt_ids) for r in got]) <= src.prompt_width
