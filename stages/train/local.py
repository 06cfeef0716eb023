"""Run a pipeline of :class:`TrainRank` in local processes (tests, benchmarks, validation).

The Dask flow keeps ranks on long-lived workers; this runner starts one spawned process per rank
for a fixed list of batches and returns what each rank measured.
"""

from __future__ import annotations

import multiprocessing as mp
import socket
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass

import torch

from stages.train.batch import GlobalBatch
from stages.train.engine import StepResult, TrainRank, TrainSetup

__all__ = ["RankOutput", "free_port", "run_local_pipeline"]


@dataclass
class RankOutput:
    rank: int
    steps: list[StepResult]
    grads: list[dict[str, torch.Tensor]]  # per batch, HF names
    state: dict[str, torch.Tensor]  # HF-named weights after the last batch


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_main(setup: TrainSetup, rank: int, init_method: str, tensors, batches, optimizer_step: bool,
               num_threads: int) -> RankOutput:
    torch.set_num_threads(num_threads)
    engine = TrainRank(setup, rank, init_method, tensors)
    try:
        steps, grads = [], []
        for b in batches:
            steps.append(engine.train_step(b) if optimizer_step else engine.forward_backward(b))
            grads.append(engine.hf_grads())
        return RankOutput(rank, steps, grads, engine.hf_state())
    finally:
        engine.close()


def run_local_pipeline(setup: TrainSetup, tensors: dict[str, torch.Tensor], batches: list[GlobalBatch],
                       optimizer_step: bool = True, num_threads: int = 1) -> list[RankOutput]:
    """Run every batch through a ``setup.num_stages``-rank pipeline; one output per rank."""
    init_method = f"tcp://127.0.0.1:{free_port()}"
    ctx = mp.get_context("spawn")
    with ProcessPoolExecutor(max_workers=setup.num_stages, mp_context=ctx) as pool:
        futures = [pool.submit(_rank_main, setup, r, init_method, tensors, batches, optimizer_step, num_threads)
                   for r in range(setup.num_stages)]
        # Every distributed wait inside has setup.timeout_s; allow start-up on top of it.
        return [f.result(timeout=setup.timeout_s * (len(batches) + 1) + 60) for f in futures]
