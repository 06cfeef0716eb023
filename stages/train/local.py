"""Run the training ranks of a layout in local processes (tests, benchmarks, validation).

The Dask flow keeps ranks on long-lived workers; this runner starts one process per rank
(pp x dp x tp of them) for a fixed list of calls and returns what each rank measured. Processes
come from a forkserver that has imported the engine once, so a run costs a fork per rank, not a
fresh interpreter importing torch (~3 s each on a loaded 2-core machine).
"""

from __future__ import annotations

import multiprocessing as mp
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from typing import Literal, Optional, Sequence

import torch

from stages.train.batch import BucketedBatch
from stages.train.engine import StepResult, TrainRank, TrainSetup
from stages.tcp_store import free_port

__all__ = ["Call", "RankOutput", "run_local_pipeline"]

Call = Literal["train", "grad", "reference", "proximal", "train_with_reference"]
"""train: train_step; grad: forward_backward (no optimiser step); reference / proximal: the
forward-only log-prob passes; train_with_reference: train_step_with_reference (its log-probs in
``logps``, store order)."""

_START_S = 60.0  # process start-up and rendezvous, on top of the per-call timeouts


@dataclass(frozen=True)
class RankOutput:
    rank: int
    steps: list[Optional[StepResult]]  # per call; forward-only passes give engine.last_forward
    grads: list[dict[str, torch.Tensor]]  # per call, HF names (empty for forward-only / failed calls)
    logps: list[Optional[torch.Tensor]]  # per call: forward-only output on the output rank ([rows, T];
    # a BucketedBatch's and train_with_reference's: [N, max_new_tokens] in store order)
    errors: list[Optional[str]]  # per call: the error it raised, or None
    seconds: list[float]  # per call: wall time on this rank
    state: dict[str, torch.Tensor]  # HF-named weights after the last call (empty if the rank was aborted)


def _one_call(engine: TrainRank, call: Call, batch):
    if call == "train_with_reference":
        step, values = engine.train_step_with_reference(batch)
        return step, engine.hf_grads(), None if values is None else torch.from_numpy(values)
    if call in ("train", "grad"):
        step = engine.train_step(batch) if call == "train" else engine.forward_backward(batch)
        return step, engine.hf_grads(), None
    what = "reference_logp" if call == "reference" else "proximal_logp"
    if isinstance(batch, BucketedBatch):  # every pass, mapped back to store order [N, max_new_tokens]
        values = engine.batch_logp(batch, what)
        return engine.last_forward, {}, None if values is None else torch.from_numpy(values)
    logp_fn = engine.reference_logp if call == "reference" else engine.proximal_logp
    logp = logp_fn(batch.input_ids, batch.target[..., 0].long(), batch.stage_kwargs())
    return engine.last_forward, {}, logp


def _rank_main(setup: TrainSetup, rank: int, init_method: str, tensors, batches, calls: Sequence[Call],
               num_threads: int, stop_on_error: bool) -> RankOutput:
    torch.set_num_threads(num_threads)
    engine = TrainRank(setup, rank, init_method, tensors)
    steps, grads, logps, errors, seconds = [], [], [], [], []
    try:
        for batch, call in zip(batches, calls):
            t0 = time.perf_counter()
            try:
                step, g, logp = _one_call(engine, call, batch)
                error = None
            except Exception as exc:
                if stop_on_error:
                    raise
                step, g, logp, error = None, {}, None, f"{type(exc).__name__}: {exc}"
            seconds.append(time.perf_counter() - t0)
            steps.append(step)
            grads.append(g)
            logps.append(logp)
            errors.append(error)
        state = {} if engine.guard.aborted else engine.hf_state()
        return RankOutput(rank, steps, grads, logps, errors, seconds, state)
    finally:
        engine.close()


def run_local_pipeline(setup: TrainSetup, tensors: dict[str, torch.Tensor], batches: list,
                       optimizer_step: bool = True, num_threads: int = 1, calls: Optional[Sequence[Call]] = None,
                       stop_on_error: bool = True) -> list[RankOutput]:
    """Run every batch on a ``setup.layout``-shaped set of ranks; one output per global rank.

    ``calls`` says what to do with each batch (default: "train" or "grad" by ``optimizer_step``).
    With ``stop_on_error=False`` a failing call is recorded in ``RankOutput.errors`` and the next
    call runs (an aborted rank fails every later call at once).
    """
    calls = list(calls) if calls is not None else ["train" if optimizer_step else "grad"] * len(batches)
    if len(calls) != len(batches):
        raise ValueError(f"{len(calls)} calls for {len(batches)} batches: give one call per batch")
    world = setup.layout.world_size
    init_method = f"tcp://127.0.0.1:{free_port()}"
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["stages.train.engine"])
    with ProcessPoolExecutor(max_workers=world, mp_context=ctx) as pool:
        futures = [pool.submit(_rank_main, setup, r, init_method, tensors, batches, calls, num_threads,
                               stop_on_error) for r in range(world)]
        # Every distributed wait inside has setup.timeout_s; allow start-up on top of it.
        limit = setup.timeout_s * (len(batches) + 1) + _START_S
        return [f.result(timeout=limit) for f in futures]
