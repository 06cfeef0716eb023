"""The matmul rate a worker actually gets: FLOP/s of one dense matmul of the project model's size,
timed on this machine with the worker's dtype, device and threads (the MFU denominator).

A CPU has no vendor peak to quote that a torch process reaches (it depends on the BLAS, the ISA and
the threads), so the rate is measured: [512, 576] x [576, 1536], 512 tokens through the up_proj of
SmolLM2-135M (h=576, F=1536), 2 * 512 * 576 * 1536 = 906 MFLOP per matmul. On a GPU the same shape is
far below the device's peak; that is the rate this model's matmuls can get there.

The result is the best of several timed samples (each of enough matmuls to last ~1/20 of the budget),
after a warm-up: a fixed matmul has no variance of its own, and slower samples come from other
processes and frequency changes, so the fastest is the truest (the advice of Python's ``timeit``
docs). The cache of results per host is :mod:`storage.host_rates`.
"""

from __future__ import annotations

import time
from typing import Optional

import torch

__all__ = ["MATMUL_SHAPE", "DTYPES", "dtype_name", "measure_matmul_rate"]

MATMUL_SHAPE = (512, 576, 1536)
"""(M, K, N) of the timed [M, K] x [K, N] matmul: 512 tokens through SmolLM2-135M's up_proj."""
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_WARMUP_FRACTION = 0.2  # of the budget, spent before timing: BLAS packing buffers, thread pool start, clocks
_SAMPLES = 20  # timed samples the rest of the budget is split into
_MIN_SAMPLES = 3  # even when one matmul outlasts the budget


def dtype_name(dtype: str | torch.dtype) -> str:
    """The config spelling ("float32", "bfloat16", "float16") of a dtype or its name."""
    name = str(dtype).removeprefix("torch.")
    if name not in DTYPES:
        raise ValueError(f"dtype {dtype!r} is not one of {', '.join(DTYPES)}")
    return name


def measure_matmul_rate(dtype: str | torch.dtype, device: str = "cpu", threads: Optional[int] = None,
                        seconds: float = 1.0) -> float:
    """FLOP/s of :data:`MATMUL_SHAPE` in ``dtype`` on ``device``, best of the timed samples.

    threads: torch intra-op threads on the CPU during the measurement (None: as set now); restored
    afterwards. seconds: about how long the measurement takes. Impure: it times this machine.
    """
    if seconds <= 0:
        raise ValueError(f"seconds={seconds} must be > 0")
    if threads is not None and threads < 1:
        raise ValueError(f"threads={threads} must be >= 1 (or None: torch's current setting)")
    dev = torch.device(device)
    before = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    try:
        return _best_rate(DTYPES[dtype_name(dtype)], dev, seconds)
    finally:
        torch.set_num_threads(before)


def _best_rate(dtype: torch.dtype, dev: torch.device, seconds: float) -> float:
    m, k, n = MATMUL_SHAPE
    gen = torch.Generator().manual_seed(0)
    a = torch.randn(m, k, generator=gen).to(dev, dtype)  # [M, K]
    b = torch.randn(k, n, generator=gen).to(dev, dtype)  # [K, N]
    out = torch.empty(m, n, device=dev, dtype=dtype)  # [M, N]

    def run(reps: int) -> float:
        _sync(dev)
        start = time.perf_counter()
        for _ in range(reps):
            torch.mm(a, b, out=out)
        _sync(dev)
        return time.perf_counter() - start

    warm_until, warm_reps, one_s = time.perf_counter() + _WARMUP_FRACTION * seconds, 0, float("inf")
    while warm_reps < 2 or time.perf_counter() < warm_until:
        one_s = min(one_s, run(1))
        warm_reps += 1
    reps = max(1, round((1 - _WARMUP_FRACTION) * seconds / _SAMPLES / one_s))  # matmuls per timed sample
    stop, best, samples = time.perf_counter() + (1 - _WARMUP_FRACTION) * seconds, float("inf"), 0
    while samples < _MIN_SAMPLES or time.perf_counter() < stop:
        best = min(best, run(reps))
        samples += 1
    return 2.0 * m * k * n * reps / best


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
