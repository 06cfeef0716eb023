"""Per-rank timelines of pipeline actions, as Chrome-trace events (open in Perfetto).

:class:`TimedStage` records the start and end of every forward, backward (full or input-only)
and weight-backward of a pipeline stage. The bubble fraction of a rank is the share of the step's
wall time in which it ran none of them.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from torch.distributed.pipelining import PipelineStage

__all__ = ["Action", "TimedStage", "bubble_fraction", "chrome_events"]


@dataclass(frozen=True)
class Action:
    kind: str  # "F" forward, "B" full backward, "I" input-backward, "W" weight-backward
    stage: int
    microbatch: int
    start_ns: int
    end_ns: int

    @property
    def seconds(self) -> float:
        return (self.end_ns - self.start_ns) / 1e9


class TimedStage(PipelineStage):
    """A PipelineStage that logs its compute actions into ``self.actions``."""

    actions: list[Action]

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.actions = []
        self.recording = True

    def _record(self, kind: str, mb: int, t0: int) -> None:
        if self.recording:
            self.actions.append(Action(kind, self.stage_index, mb, t0, time.time_ns()))

    def forward_one_chunk(self, fwd_chunk_id, *args, **kwargs):
        t0 = time.time_ns()
        out = super().forward_one_chunk(fwd_chunk_id, *args, **kwargs)
        self._record("F", fwd_chunk_id, t0)
        return out

    def backward_one_chunk(self, bwd_chunk_id, loss=None, full_backward=True, last_backward=False):
        t0 = time.time_ns()
        out = super().backward_one_chunk(bwd_chunk_id, loss=loss, full_backward=full_backward,
                                         last_backward=last_backward)
        self._record("B" if full_backward else "I", bwd_chunk_id, t0)
        return out

    def backward_weight_one_chunk(self, bwd_chunk_id, last_backward=False):
        t0 = time.time_ns()
        out = super().backward_weight_one_chunk(bwd_chunk_id, last_backward=last_backward)
        self._record("W", bwd_chunk_id, t0)
        return out


def bubble_fraction(actions: list[Action], window_start_ns: int, window_end_ns: int) -> float:
    """1 - (time spent in actions) / (step window) for one rank."""
    window = max(window_end_ns - window_start_ns, 1)
    busy = sum(a.end_ns - a.start_ns for a in actions)
    return max(0.0, 1.0 - busy / window)


def chrome_events(rank: int, actions: list[Action], window: tuple[int, int], origin_ns: int) -> list[dict]:
    """Complete ('X') events in microseconds from ``origin_ns``; pid is the rank."""
    events = [{"name": "process_name", "ph": "M", "pid": rank, "args": {"name": f"rank {rank}"}}]
    events.append({"name": "step", "ph": "X", "pid": rank, "tid": 1, "ts": (window[0] - origin_ns) / 1e3,
                   "dur": (window[1] - window[0]) / 1e3, "args": {}})
    for a in actions:
        events.append({"name": f"{a.kind}{a.microbatch}", "cat": a.kind, "ph": "X", "pid": rank, "tid": 0,
                       "ts": (a.start_ns - origin_ns) / 1e3, "dur": (a.end_ns - a.start_ns) / 1e3,
                       "args": {"stage": a.stage, "microbatch": a.microbatch, "kind": a.kind}})
    return events
