"""Failing loudly instead of hanging: input agreement, failure reports, injected faults.

Two ways a distributed step goes wrong, and what each rank does:

1. The ranks were given inputs that do not agree (batch shape, microbatch count, keyword
   tensors). Before the pipeline runs, every rank all-gathers a digest of a small signature of
   its inputs, and the signatures themselves when the digests differ
   (:meth:`StepGuard.check_inputs`); all ranks see the same table and raise the same
   :class:`InputMismatchError` naming the odd rank and field. The process group stays healthy.
2. A rank fails mid-step (an exception, or a peer that never answers). The rank posts
   "rank r: cause" to the rendezvous store under the call's number and marks itself aborted. Its
   peers are then blocked on sends, receives or collectives that can no longer complete; each of
   those waits ends at ``train.timeout_s`` (gloo's own bound), and the survivor posts its report
   and reads the first one posted (a survivor only fails after the first failure was posted). So
   every rank ends the call within the timeout with a :class:`TrainStepError` naming the rank
   that failed first and its cause. The failed process group is not destroyed there and then:
   gloo closes a pair's connection only once every Python reference to the group is gone, which
   the pipeline stages, meshes and DTensors still hold, so destroying it would not wake the peers.
   An aborted rank refuses later calls.

:class:`InjectedFault` makes one rank raise, stall or feed a wrong shape; tests use it to check
the above.
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta
from typing import Iterator, Literal, Optional

import numpy as np
import torch
import torch.distributed as dist

__all__ = ["TrainStepError", "TrainInputError", "InputMismatchError", "NonFiniteGradientError", "InjectedFault",
           "StepGuard", "signature_of", "passes_signature"]

log = logging.getLogger(__name__)

_PREFIX = "grpoflow/"
_READ_TIMEOUT = timedelta(seconds=5)  # reading a report that is known to exist


class TrainStepError(RuntimeError):
    """A distributed training call failed; the message names the failing rank and the cause."""


class TrainInputError(TrainStepError):
    """The training inputs are unusable, the same way on every rank (the process group stays up)."""


class InputMismatchError(TrainInputError):
    """The ranks were given training inputs that do not agree."""


class NonFiniteGradientError(TrainInputError):
    """The step's gradient norm is NaN or infinite (seen alike by every rank: it is all-reduced);
    no optimiser step was taken, so nothing non-finite is published."""


@dataclass(frozen=True)
class InjectedFault:
    """Test-only: on global rank ``rank``, during its ``step``-th pass (0-based, counting training
    steps and forward-only passes), ``raise`` in the forward of ``microbatch``, ``stall`` there for
    ``seconds``, feed a ``shape`` one row short, or drop the last of a step's ``passes``. They fire
    in pipelined passes; a data-parallel reference pass (reference_parallel=data) counts in the
    numbering but runs none of them."""

    rank: int
    kind: Literal["raise", "stall", "shape", "passes"]
    step: int = 0
    microbatch: int = 0
    seconds: float = 0.0


def signature_of(num_microbatches: int, args: dict[str, torch.Tensor]) -> dict[str, str]:
    """What every rank must agree on: the microbatch count and each input tensor's shape and dtype."""
    sig = {"num_microbatches": str(num_microbatches)}
    for name, t in sorted(args.items()):
        sig[name] = f"{tuple(t.shape)}:{str(t.dtype).removeprefix('torch.')}"
    return sig


def passes_signature(passes: list[tuple[int, dict[str, torch.Tensor]]]) -> tuple[dict[str, str], list[dict[str, str]]]:
    """What every rank must agree on for a call of (m, inputs) pipeline passes: their count and each
    pass's signature_of (a single pass keeps today's plain keys); and each pass's own signature."""
    each = [signature_of(m, args) for m, args in passes]
    sig = {"num_passes": str(len(passes))}
    for i, one in enumerate(each):
        sig.update({(f"pass{i}/" if len(passes) > 1 else "") + k: v for k, v in one.items()})
    return sig, each


class StepGuard:
    """Input checks and failure reports of one rank (see the module docstring)."""

    def __init__(self, store: dist.Store, rank: int, world_size: int, describe_rank: str):
        self.store, self.rank, self.world_size = store, rank, world_size
        self.where = describe_rank
        self.aborted: Optional[str] = None

    def check_inputs(self, call: int, signature: dict[str, str],
                     extra: Optional[np.ndarray] = None) -> Optional[list[np.ndarray]]:
        """Raise :class:`InputMismatchError` on every rank if any rank's signature differs. The
        ranks all-gather a sha256 of their signature, one collective of 32 bytes each (each
        collective a rank waits in is a chance for a busy host to deschedule one of them); only
        when the digests differ do they gather the signatures themselves, to name what differs.
        ``extra``: an int64 vector of the same size on every rank, gathered in the same collective;
        returns every rank's (None without it)."""
        mine = hashlib.sha256(json.dumps(signature, sort_keys=True).encode()).digest()
        payload = bytearray(mine) + (bytearray(np.ascontiguousarray(extra, np.int64).tobytes())
                                     if extra is not None else bytearray())
        digest = torch.frombuffer(payload, dtype=torch.uint8)
        digests = [torch.empty_like(digest) for _ in range(self.world_size)]
        dist.all_gather(digests, digest)
        if all(torch.equal(d[:32], digests[0][:32]) for d in digests):
            if extra is None:
                return None
            return [np.frombuffer(d[32:].numpy().tobytes(), np.int64) for d in digests]
        table: list[Optional[dict[str, str]]] = [None] * self.world_size
        dist.all_gather_object(table, signature)
        raise InputMismatchError(f"call {call}: training inputs disagree across ranks: "
                                 + _describe_mismatch(table)
                                 + "; every rank must build the same global batch (same step, same config)")

    @contextmanager
    def guarded(self, call: str, what: str) -> Iterator[None]:
        """Turn any failure inside into a :class:`TrainStepError` naming the first failing rank,
        aborting this rank's process group so that its peers fail fast too."""
        if self.aborted:
            raise TrainStepError(f"{self.where}: this training rank was aborted ({self.aborted}); "
                                 "restart the run to train again")
        try:
            yield
        except TrainInputError:
            raise
        except Exception as exc:
            raise self._abort(call, what, exc) from exc

    def _abort(self, call: str, what: str, exc: BaseException) -> TrainStepError:
        own = f"{self.where}: {type(exc).__name__}: {_first_line(exc)}"
        first = own
        try:
            n = self.store.add(f"{_PREFIX}fail/{call}/count", 1)
            self.store.set(f"{_PREFIX}fail/{call}/{n}", own)
            if n > 1:
                self.store.set_timeout(_READ_TIMEOUT)
                first = self.store.get(f"{_PREFIX}fail/{call}/1").decode()
        except Exception:  # the store's host is gone too: report what this rank saw
            log.warning("%s: could not read the failure reports of call %s", self.where, call)
        self.aborted = f"{what} call {call} failed"
        if first == own:
            return TrainStepError(f"{what} (call {call}) failed on {own}")
        return TrainStepError(f"{what} (call {call}) aborted on {self.where}; the first failure was on {first} "
                              f"(here: {type(exc).__name__}: {_first_line(exc)})")

    def close(self, owner: bool, timeout_s: float) -> None:
        """Check out; the store's host (rank 0) waits up to ``timeout_s`` for every rank to check
        out, so that failure reports stay readable while any rank may still look for them."""
        try:
            count = self.store.add(f"{_PREFIX}closed", 1)
            deadline = time.monotonic() + timeout_s
            while owner and count < self.world_size and time.monotonic() < deadline:
                time.sleep(0.05)
                count = self.store.add(f"{_PREFIX}closed", 0)
        except Exception:
            log.warning("%s: the rendezvous store went away before every rank checked out", self.where)


def _first_line(exc: BaseException) -> str:
    """The first line of the message, followed by its causes' (torch wraps a stage's error in
    "[Stage 1] failed to run forward:" and the cause)."""
    parts, seen = [], 0
    while exc is not None and seen < 3:
        text = str(exc).strip()
        line = text.splitlines()[0].strip() if text else ""
        if line and not any(line in p for p in parts):  # a wrapper may quote its cause
            parts.append(line if not parts else f"{type(exc).__name__}: {line}")
        exc, seen = exc.__cause__, seen + 1
    return " <- ".join(parts) or "no message"


def _describe_mismatch(table: list) -> str:
    """'rank 1 has input_ids=(15, 11):int64 where rank 0 has (16, 11):int64' for each field where a
    rank departs from the most common value (the lowest rank's value on a tie)."""
    parts = []
    for name in sorted({k for t in table for k in t}):
        values = [t.get(name, "nothing") for t in table]
        common = max(values, key=lambda v: (values.count(v), -values.index(v)))
        holder = values.index(common)
        for rank, v in enumerate(values):
            if v != common:
                parts.append(f"rank {rank} has {name}={v} where rank {holder} has {common}")
    return "; ".join(parts[:4])
