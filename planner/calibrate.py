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

__all__ = ["estimate_durations_from_timeline", "relative_error"]

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


def relative_error(predicted: float, measured: float) -> float:
    """|predicted - measured| / measured, the number the runtime checks hold under 10%."""
    return abs(predicted - measured) / measured
