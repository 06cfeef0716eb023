"""Runtime timelines -> simulator inputs, for checking the planner against what the runtime measures.

The runtime writes per-rank start/end of every action (Chrome/Perfetto trace). Accepted records:

- objects with ``kind``, ``stage``, ``start_ns``, ``end_ns`` attributes (the runtime's timeline actions);
- mappings ``{"stage": 1, "kind": "F", "start_s": ..., "end_s": ...}``;
- Chrome trace events whose ``args`` carry ``stage`` and ``kind`` (the runtime's ``chrome_events``),
  with ``dur`` in microseconds;
- Chrome trace events named ``PP:{stage}{kind}{microbatch}`` (torch.distributed.pipelining's profiler).

Kinds are F/B/I/W for compute and SEND_F/RECV_F/SEND_B/RECV_B for transfers.
"""

from __future__ import annotations

import re
from collections import defaultdict
from collections.abc import Iterable, Mapping
from typing import Any

from planner.simulator import ActionDurations

__all__ = ["estimate_durations_from_timeline", "estimate_durations_from_trace", "measured_step_seconds",
           "relative_error"]

_ACTION_NAME = re.compile(r"^(?:PP:)?(\d+)(F|B|I|W|SEND_F|RECV_F|SEND_B|RECV_B)(\d*)$")
_US = 1e-6  # Chrome trace timestamps are microseconds
_TRANSFER_KINDS = ("SEND_F", "RECV_F", "SEND_B", "RECV_B")


def _parse(record: Any) -> tuple[int, str, float] | None:
    """(stage, kind, seconds) of one record, or None for records that are not pipeline actions."""
    if not isinstance(record, Mapping):
        return int(record.stage), str(record.kind), (record.end_ns - record.start_ns) / 1e9
    if "kind" in record:
        return int(record["stage"]), str(record["kind"]), float(record["end_s"]) - float(record["start_s"])
    args = record.get("args") or {}
    if "kind" in args and "stage" in args and "dur" in record:
        return int(args["stage"]), str(args["kind"]), float(record["dur"]) * _US
    match = _ACTION_NAME.match(str(record.get("name", "")))
    if match is None or "dur" not in record:
        return None
    return int(match.group(1)), match.group(2), float(record["dur"]) * _US


def estimate_durations_from_timeline(records: Iterable[Any]) -> ActionDurations:
    """Mean seconds per (virtual stage, kind) of a measured step, plus the mean transfer time as ``p2p_s``.

    Feed the result to ``simulate_schedule(schedule, num_stages, num_microbatches, num_virtual, durations)``
    and compare its ``makespan_s`` with the step time the runtime measured.
    """
    sums: dict[tuple[int, str], float] = defaultdict(float)
    counts: dict[tuple[int, str], int] = defaultdict(int)
    transfer_sum, transfer_count = 0.0, 0
    for record in records:
        parsed = _parse(record)
        if parsed is None:
            continue
        stage, kind, seconds = parsed
        if kind in _TRANSFER_KINDS:
            transfer_sum, transfer_count = transfer_sum + seconds, transfer_count + 1
            continue
        sums[stage, kind] += seconds
        counts[stage, kind] += 1
    if not sums:
        raise ValueError("timeline has no pipeline actions (expected kinds F/B/I/W or names like 'PP:0F1')")
    means = {key: sums[key] / counts[key] for key in sums}
    return ActionDurations.from_means(means, p2p_s=transfer_sum / transfer_count if transfer_count else 0.0)


def _union_within(intervals: list[tuple[float, float]], lo: float, hi: float) -> float:
    """Length of the union of ``intervals`` clipped to [lo, hi]."""
    total, end = 0.0, lo
    for start, stop in sorted(intervals):
        start, stop = max(start, end), min(stop, hi)
        if stop > start:
            total, end = total + stop - start, stop
    return total


def _by_rank(events: Iterable[Mapping[str, Any]]) -> dict[int, dict[str, list]]:
    ranks: dict[int, dict[str, list]] = defaultdict(lambda: {"compute": [], "comm": [], "window": []})
    for e in events:
        if e.get("ph") != "X":
            continue
        args, start = e.get("args") or {}, float(e["ts"]) * _US
        span = (start, start + float(e["dur"]) * _US)
        kind = args.get("kind")
        if kind in _TRANSFER_KINDS:
            ranks[e["pid"]]["comm"].append((kind, int(args["stage"]), args.get("microbatch"), span,
                                            float(args.get("wait_us", 0.0)) * _US))
        elif kind is not None:
            ranks[e["pid"]]["compute"].append((kind, int(args["stage"]), span))
        elif e.get("name") == "step":
            ranks[e["pid"]]["window"].append(span)
    return ranks


def measured_step_seconds(events: Iterable[Mapping[str, Any]]) -> float:
    """The step as the pipeline saw it: the first rank's start to the last rank's end."""
    windows = [w for r in _by_rank(events).values() for w in r["window"]]
    if not windows:
        raise ValueError("trace has no 'step' window events")
    return max(w[1] for w in windows) - min(w[0] for w in windows)


def estimate_durations_from_trace(events: Iterable[Mapping[str, Any]]) -> ActionDurations:
    """Simulator inputs from one step of the runtime's Chrome trace (runs/<run>/timelines/step_k.json).

    Each compute action counts as long as it *occupied* its rank: from its start to the start of the
    rank's next compute action (the end of the step window for the last one), less the time the rank
    sat blocked waiting on a peer. That adds what runs on the rank between actions and the simulator has
    no separate term for: the host-side copy of each send and receive, the loss after a last-stage
    forward, the schedule's bookkeeping. The transfer latency ``p2p_s`` is the fastest matched
    send -> receive of the step (post of the later of the two to the end of the receive): a SEND/RECV
    span runs from its post to the end of its wait and so also holds the peer's compute, which is why
    :func:`estimate_durations_from_timeline`'s mean span is no latency for a multi-stage step.
    """
    events = list(events)
    ranks = _by_rank(events)
    records, sends, transfers = [], {}, []
    for r in ranks.values():
        compute = sorted(r["compute"], key=lambda c: c[2][0])
        waits = [(end - wait, end) for _, _, _, (_, end), wait in r["comm"]]
        stop = max((w[1] for w in r["window"]), default=compute[-1][2][1] if compute else 0.0)
        for (kind, stage, (start, end)), after in zip(compute, compute[1:] + [None]):
            until = after[2][0] if after is not None else stop
            occupied = until - start - _union_within(waits, end, until)
            records.append({"stage": stage, "kind": kind, "start_s": start, "end_s": start + occupied})
        for kind, stage, mb, span, _ in r["comm"]:
            if kind.startswith("SEND"):
                sends[kind[-1], stage + (1 if kind == "SEND_F" else -1), mb] = span
    for r in ranks.values():
        for kind, stage, mb, (start, end), _ in r["comm"]:
            send = sends.get((kind[-1], stage, mb)) if kind.startswith("RECV") else None
            if send is not None:
                transfers.append(end - max(start, send[0]))
    means = estimate_durations_from_timeline(records).per_stage
    return ActionDurations.from_means(means, p2p_s=min(transfers) if transfers else 0.0)


def relative_error(predicted: float, measured: float) -> float:
    """|predicted - measured| / measured, the number the runtime checks hold under 10%."""
    return abs(predicted - measured) / measured
