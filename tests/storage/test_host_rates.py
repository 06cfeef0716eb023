"""The per-host matmul-rate cache (storage/host_rates.py) and the measurement it caches."""

from __future__ import annotations

import json
import os

import pytest
import torch

import storage.host_rates as host_rates
from stages.perf.matmul_rate import measure_matmul_rate
from storage.host_rates import HostRatesError, host_rate_key, load_host_rates, matmul_rate, save_host_rates

_FAKE_RATE = 1.25e10  # FLOP/s the counting measurer reports


@pytest.fixture
def measured(monkeypatch) -> list[tuple]:
    """The measurer replaced by one that records its calls and answers at once."""
    calls: list[tuple] = []

    def fake(dtype, device="cpu", threads=None, seconds=1.0):
        calls.append((dtype, device, threads))
        return _FAKE_RATE * (1 + len(calls))  # a new value each call: a reused rate is the cached one

    monkeypatch.setattr(host_rates, "measure_matmul_rate", fake)
    return calls


def test_a_cached_rate_is_reused(tmp_path, measured):
    path = tmp_path / "_cache" / "host_rates.json"  # the folder is made on the first write
    first = matmul_rate(path, "float32", "cpu", threads=1)
    assert matmul_rate(path, torch.float32, "cpu", threads=1) == first  # a dtype or its name: one key
    assert len(measured) == 1
    assert json.loads(path.read_text()) == {host_rate_key("float32", "cpu", 1): first}


def test_the_key_changes_with_dtype_threads_and_device(tmp_path, measured):
    path = tmp_path / "host_rates.json"
    for dtype, threads in (("float32", 1), ("bfloat16", 1), ("float32", 2), ("float32", 1)):
        matmul_rate(path, dtype, "cpu", threads)
    assert len(measured) == 3 and len(load_host_rates(path)) == 3
    keys = {host_rate_key("float32", "cpu", 1), host_rate_key("bfloat16", "cpu", 1), host_rate_key("float32", "cpu", 2),
            host_rate_key("float32", "meta", 1)}
    assert len(keys) == 4
    key = host_rate_key("float32", "cpu", 1)
    assert f"torch={torch.__version__}/" in key and "/threads=1/" in key and "/mm=512x576x1536" in key
    assert host_rate_key("float32", "cpu", None) == host_rate_key("float32", "cpu", torch.get_num_threads())


@pytest.mark.parametrize("content", ["{not json", "[1, 2]", '{"%s": -3.0}', "\udcff", ""])
def test_a_corrupt_cache_is_measured_again_and_rewritten(tmp_path, measured, content):
    path = tmp_path / "host_rates.json"
    key = host_rate_key("float32", "cpu", 1)
    path.write_bytes(content.replace("%s", key).encode("utf-8", "surrogateescape"))
    rate = matmul_rate(path, "float32", "cpu", 1)
    assert len(measured) == 1
    assert load_host_rates(path) == {key: rate}


def test_other_hosts_entries_are_kept(tmp_path, measured):
    path = tmp_path / "host_rates.json"
    save_host_rates(path, {"host=other/cpu=x": 5e9})
    matmul_rate(path, "float32", "cpu", 1)
    assert load_host_rates(path)["host=other/cpu=x"] == 5e9 and len(load_host_rates(path)) == 2


def test_an_unwritable_cache_does_not_stop_the_run(tmp_path, measured, caplog):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    path = blocker / "host_rates.json"  # its folder is a file: nothing can be written there
    assert matmul_rate(path, "float32", "cpu", 1) == 2 * _FAKE_RATE
    assert "not cached" in caplog.text


def test_a_failed_write_leaves_the_old_file_whole(tmp_path, monkeypatch):
    path = tmp_path / "host_rates.json"
    save_host_rates(path, {"k": 1e9})

    def fail(src, dst):
        raise OSError("disk full")

    monkeypatch.setattr(os, "replace", fail)
    with pytest.raises(HostRatesError, match="host_rates.json"):
        save_host_rates(path, {"k": 2e9})
    assert load_host_rates(path) == {"k": 1e9}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["host_rates.json"]  # no temporary file left


def test_the_measured_rate_is_plausible_and_threads_are_restored():
    before = torch.get_num_threads()
    rate = measure_matmul_rate("float32", "cpu", threads=1, seconds=0.2)
    assert torch.get_num_threads() == before
    # > 100 MFLOP/s: any CPU torch supports; < 10 TFLOP/s: more than one core can do in float32.
    assert 1e8 < rate < 1e13
    with pytest.raises(ValueError, match="dtype"):
        measure_matmul_rate("int8")


def test_a_refresh_keeps_the_highest_rate_seen(tmp_path, monkeypatch):
    """A start beside busy processes measures low; the cache keeps the peak, and a quiet refresh raises it."""
    measured = iter([5e10, 3e10, 9e10])
    monkeypatch.setattr(host_rates, "measure_matmul_rate", lambda *a, **k: next(measured))
    path = tmp_path / "rates.json"
    assert host_rates.matmul_rate(path, "float32", "cpu", 1) == 5e10
    assert host_rates.matmul_rate(path, "float32", "cpu", 1, refresh_seconds=0.1) == 5e10  # 3e10: busy
    assert host_rates.matmul_rate(path, "float32", "cpu", 1, refresh_seconds=0.1) == 9e10
    assert host_rates.matmul_rate(path, "float32", "cpu", 1) == 9e10  # cached, no measurement left
