"""Per-rank timelines of pipeline actions, as Chrome-trace events (open in Perfetto), and the
activation stash they imply.

:class:`TimedStage` records the start and end of every forward (F), full backward (B),
input-backward (I) and weight-backward (W) of a pipeline stage. Sends and receives are recorded by
:func:`timed_p2p`: torch's schedules post every P2P op through
``torch.distributed.pipelining.schedules._batch_p2p`` and only ever call ``.wait()`` on the works it
returns (single-stage schedules and ``_PipelineScheduleRuntime`` alike), so wrapping that one
function times each op from its post to the end of its wait. Gloo works have no future to report
completion (``Work::getFuture not implemented``), so the end of a send waited late is its wait.

Bubble fraction of a rank = 1 - (time in compute actions) / (step window); a reference
microbatch computed inside a send or receive wait (R, stages/train/fill.py) counts as compute.

Activation stash: the bytes each stage forward saves for backward (a
``torch.autograd.graph.saved_tensors_hooks`` around the forward; distinct storages, parameters
excluded, a microbatch input by its own bytes), and the peak number of microbatches forwarded and
not yet fully backwarded per stage (a microbatch leaves at its B, or at its W when the backward is
split into I and W).
"""

from __future__ import annotations

import time
from collections import defaultdict
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from typing import Callable, Iterator, Optional

import torch
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining import schedules as _schedules
from torch.distributed.tensor import DTensor
from torch.utils._pytree import tree_leaves

__all__ = ["Action", "COMPUTE_KINDS", "COMM_KINDS", "FILL_KIND", "P2PWaitHook", "RankTimeline", "TimedStage",
           "autocast_to", "timed_p2p", "bubble_fraction", "chrome_events"]

COMPUTE_KINDS = ("F", "B", "I", "W")
FILL_KIND = "R"  # a frozen reference microbatch computed inside a send or receive wait (stages/train/fill.py)
COMM_KINDS = ("SEND_F", "RECV_F", "SEND_B", "RECV_B")
_LABEL = "_grpoflow_label"  # attribute set on each P2POp a TimedStage hands to a schedule


@dataclass(frozen=True)
class Action:
    kind: str  # a COMPUTE_KINDS or COMM_KINDS entry, or FILL_KIND
    stage: int
    microbatch: int
    start_ns: int
    end_ns: int
    peer: int = -1  # send/recv: the peer's global rank
    wait_ns: int = 0  # send/recv: time blocked in wait()
    num_bytes: int = 0  # send/recv: the tensor's bytes

    @property
    def seconds(self) -> float:
        return (self.end_ns - self.start_ns) / 1e9


class RankTimeline:
    """What one rank's stages did in a step: actions, stash bytes, microbatches in flight."""

    def __init__(self) -> None:
        self.recording = True
        self.clear()

    def clear(self) -> None:
        self.actions: list[Action] = []
        self.stash_bytes: dict[int, list[int]] = defaultdict(list)  # stage -> bytes per microbatch
        self.in_flight: dict[int, int] = defaultdict(int)
        self.peak_in_flight: dict[int, int] = defaultdict(int)

    def record(self, action: Action) -> None:
        if self.recording:
            self.actions.append(action)

    def enter(self, stage: int) -> None:
        self.in_flight[stage] += 1
        self.peak_in_flight[stage] = max(self.peak_in_flight[stage], self.in_flight[stage])

    def leave(self, stage: int) -> None:
        self.in_flight[stage] -= 1

    def stash_metrics(self) -> dict[str, float]:
        """activation_bytes_per_microbatch_stage{i} (largest microbatch) and peak_inflight_stage{i}."""
        out: dict[str, float] = {}
        for stage, sizes in sorted(self.stash_bytes.items()):
            out[f"activation_bytes_per_microbatch_stage{stage}"] = float(max(sizes))
        for stage, peak in sorted(self.peak_in_flight.items()):
            out[f"peak_inflight_stage{stage}"] = float(peak)
        return out

    def p2p_metrics(self) -> dict[str, float]:
        """p2p_send_bytes: the activations and gradients this rank sent to other pipeline ranks."""
        return {"p2p_send_bytes": float(sum(a.num_bytes for a in self.actions if a.kind.startswith("SEND")))}


def _storage_key(t: torch.Tensor) -> int:
    if isinstance(t, DTensor):
        t = t.to_local()
    return t.untyped_storage().data_ptr()


def autocast_to(device: torch.device, dtype: Optional[torch.dtype]):
    """torch.autocast on ``device``'s type in ``dtype``; a no-op context for None."""
    return nullcontext() if dtype is None else torch.autocast(device.type, dtype=dtype)


class TimedStage(PipelineStage):
    """A PipelineStage that logs its actions, stash and P2P ops into a shared :class:`RankTimeline`.

    ``before_forward(stage_index, microbatch)``, when set, runs before each forward (the engine's
    fault injection for tests).
    """

    def __init__(self, *args, timeline: Optional[RankTimeline] = None,
                 before_forward: Optional[Callable[[int, int], None]] = None,
                 autocast: Optional[torch.dtype] = None, **kwargs):
        super().__init__(*args, **kwargs)
        self.timeline = timeline if timeline is not None else RankTimeline()
        self.before_forward = before_forward
        self.autocast = autocast  # forwards under torch.autocast in this dtype (None: the weights' dtype)
        self._param_keys = {_storage_key(p) for p in self.submod.parameters()}

    @property
    def actions(self) -> list[Action]:
        return self.timeline.actions

    def _prepare_forward_infra(self, *args, **kwargs):
        # Shape inference runs the stage's forward once before the first step: under the same
        # autocast, so the dtypes it records are those the step's forwards produce (torch checks them).
        with autocast_to(self.device, self.autocast):
            return super()._prepare_forward_infra(*args, **kwargs)

    def _record(self, kind: str, mb: int, t0: int) -> None:
        self.timeline.record(Action(kind, self.stage_index, mb, t0, time.time_ns()))

    def forward_one_chunk(self, fwd_chunk_id, *args, **kwargs):
        if self.before_forward is not None:
            self.before_forward(self.stage_index, fwd_chunk_id)
        saving = self.has_backward and torch.is_grad_enabled()
        seen: set[int] = set()
        total = [0]
        # Microbatch inputs are views into the whole batch (torch splits it with tensor_split): they
        # count their own bytes, not those of the batch's storage.
        inputs = {_storage_key(t) for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}

        def pack(t: torch.Tensor) -> torch.Tensor:
            key = _storage_key(t)
            if key not in seen and key not in self._param_keys:
                seen.add(key)
                local = t.to_local() if isinstance(t, DTensor) else t
                total[0] += local.nbytes if key in inputs else local.untyped_storage().nbytes()
            return t

        t0 = time.time_ns()
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), autocast_to(self.device, self.autocast):
            out = super().forward_one_chunk(fwd_chunk_id, *args, **kwargs)
        self._record("F", fwd_chunk_id, t0)
        if saving and self.timeline.recording:
            self.timeline.stash_bytes[self.stage_index].append(total[0])
            self.timeline.enter(self.stage_index)
        return out

    def backward_one_chunk(self, bwd_chunk_id, loss=None, full_backward=True, last_backward=False):
        t0 = time.time_ns()
        out = super().backward_one_chunk(bwd_chunk_id, loss=loss, full_backward=full_backward,
                                         last_backward=last_backward)
        if self.has_backward:
            self._record("B" if full_backward else "I", bwd_chunk_id, t0)
            if full_backward and self.timeline.recording:
                self.timeline.leave(self.stage_index)
        return out

    def backward_weight_one_chunk(self, bwd_chunk_id, last_backward=False):
        t0 = time.time_ns()
        out = super().backward_weight_one_chunk(bwd_chunk_id, last_backward=last_backward)
        if self.has_backward:
            self._record("W", bwd_chunk_id, t0)
            if self.timeline.recording:
                self.timeline.leave(self.stage_index)
        return out

    # -- P2P ops carry a label that timed_p2p turns into a send/recv action ------------------------
    def _label(self, ops: list, kind: str, mb: int) -> list:
        for op in ops:
            setattr(op, _LABEL, (self.timeline, kind, self.stage_index, mb, op.peer,
                                 op.tensor.numel() * op.tensor.element_size()))
        return ops

    def get_fwd_recv_ops(self, fwd_chunk_id):
        return self._label(super().get_fwd_recv_ops(fwd_chunk_id), "RECV_F", fwd_chunk_id)

    def get_bwd_recv_ops(self, bwd_chunk_id):
        return self._label(super().get_bwd_recv_ops(bwd_chunk_id), "RECV_B", bwd_chunk_id)

    def get_fwd_send_ops(self, fwd_chunk_id):
        return self._label(super().get_fwd_send_ops(fwd_chunk_id), "SEND_F", fwd_chunk_id)

    def get_bwd_send_ops(self, bwd_chunk_id):
        return self._label(super().get_bwd_send_ops(bwd_chunk_id), "SEND_B", bwd_chunk_id)


class P2PWaitHook:
    """Called around each wait on a send or a receive under :func:`timed_p2p`: ``before`` may
    compute something the wait would otherwise idle through; ``after`` gets the wait's start
    (before ``before``), the end of ``before`` and the op's completion, in time.time_ns(). (A gloo
    send of a schedule completes when its peer has received it, so a rank whose peer is busy
    idles in its send's wait as often as in a receive's.)"""

    def before(self) -> None:
        pass

    def after(self, start_ns: int, blocked_from_ns: int, end_ns: int) -> None:
        pass


class _TimedWork:
    """A dist.Work that records a send/recv action when waited on."""

    def __init__(self, work, label: tuple, posted_ns: int, hook: Optional[P2PWaitHook] = None):
        self._work, self._label, self._posted_ns = work, label, posted_ns
        self._hook = hook

    def wait(self, *args, **kwargs):
        timeline, kind, stage, mb, peer, num_bytes = self._label
        start = time.time_ns()
        if self._hook is not None:
            self._hook.before()
        t0 = time.time_ns()
        try:
            result = self._work.wait(*args, **kwargs)
        except RuntimeError as exc:  # gloo does not say which peer it was waiting on
            text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise RuntimeError(f"{kind} of stage {stage} microbatch {mb} with rank {peer}: {text}") from exc
        end = time.time_ns()
        timeline.record(Action(kind, stage, mb, self._posted_ns, end, peer, end - t0, num_bytes))
        if self._hook is not None:
            self._hook.after(start, t0, end)
        return result

    def __getattr__(self, name):
        return getattr(self._work, name)


@contextmanager
def timed_p2p(hook: Optional[P2PWaitHook] = None) -> Iterator[None]:
    """While active, every P2P op a TimedStage hands to a torch schedule is timed (module docstring),
    and ``hook`` runs around each wait on a send or receive. Restores torch's ``_batch_p2p`` on exit."""
    original = _schedules._batch_p2p

    def batch_p2p(p2p_ops, desc=None):
        posted = time.time_ns()
        works = original(p2p_ops, desc)
        labels = [getattr(op, _LABEL, None) for op in p2p_ops]
        if len(works) != len(labels):  # coalesced (NCCL): one work for the batch
            labels = [labels[0] if labels else None] * len(works)
        return [_TimedWork(w, lab, posted, hook) if lab is not None else w for w, lab in zip(works, labels)]

    _schedules._batch_p2p = batch_p2p
    try:
        yield
    finally:
        _schedules._batch_p2p = original


def bubble_fraction(actions: list[Action], window_start_ns: int, window_end_ns: int) -> float:
    """1 - (time spent in compute actions, fills included) / (step window) for one rank."""
    window = max(window_end_ns - window_start_ns, 1)
    busy = sum(a.end_ns - a.start_ns for a in actions if a.kind in COMPUTE_KINDS or a.kind == FILL_KIND)
    return max(0.0, 1.0 - busy / window)


def chrome_events(rank: int, actions: list[Action], window: tuple[int, int], origin_ns: int) -> list[dict]:
    """Complete ('X') events in microseconds from ``origin_ns``; pid is the rank, tid 0 compute,
    tid 1 send/recv (from post to the end of its wait), tid 2 the step window."""
    events = [{"name": "process_name", "ph": "M", "pid": rank, "args": {"name": f"rank {rank}"}}]
    for tid, name in ((0, "compute"), (1, "send/recv"), (2, "step")):
        events.append({"name": "thread_name", "ph": "M", "pid": rank, "tid": tid, "args": {"name": name}})
    events.append({"name": "step", "ph": "X", "pid": rank, "tid": 2, "ts": (window[0] - origin_ns) / 1e3,
                   "dur": (window[1] - window[0]) / 1e3, "args": {}})
    for a in actions:
        comm = a.kind in COMM_KINDS
        args = {"stage": a.stage, "microbatch": a.microbatch, "kind": a.kind}
        if comm:
            args.update(peer=a.peer, wait_us=a.wait_ns / 1e3, bytes=a.num_bytes)
        events.append({"name": f"{a.kind}{a.microbatch}" + (f".s{a.stage}" if not comm else ""), "cat": a.kind,
                       "ph": "X", "pid": rank, "tid": 1 if comm else 0, "ts": (a.start_ns - origin_ns) / 1e3,
                       "dur": (a.end_ns - a.start_ns) / 1e3, "args": args})
    return events
