"""A runtime timeline round-trips through calibration into the same simulated step."""

import pytest

from planner.calibrate import estimate_durations_from_timeline, relative_error
from planner.simulator import ActionDurations, simulate_schedule


def _timeline(sim):
    return [{"stage": e.stage, "kind": e.kind, "start_s": e.start_s, "end_s": e.end_s} for e in sim.events]


@pytest.mark.parametrize(("schedule", "v"), [("1f1b", 1), ("zb-h1", 1), ("interleaved-1f1b", 2), ("zbv", 2)])
def test_measured_means_reproduce_the_step(schedule, v):
    per_stage = {(s, k): 0.01 * (s + 1) * {"F": 1.0, "I": 1.1, "W": 0.9, "B": 2.0}[k]
                 for s in range(4 * v) for k in ("F", "I", "W", "B")}
    truth = simulate_schedule(schedule, 4, 8, v, ActionDurations(per_stage=per_stage, p2p_s=0.002))
    records = _timeline(truth) + [{"stage": 0, "kind": "RECV_F", "start_s": 0.0, "end_s": 0.002}]
    fitted = estimate_durations_from_timeline(records)
    again = simulate_schedule(schedule, 4, 8, v, fitted)
    assert fitted.p2p_s == pytest.approx(0.002)
    assert relative_error(again.makespan_s, truth.makespan_s) < 1e-9


def test_chrome_trace_names_from_torch_profiler_are_understood():
    events = [{"name": "PP:0F0", "ts": 0, "dur": 1000}, {"name": "PP:0F1", "ts": 1000, "dur": 3000},
              {"name": "PP:0B0", "ts": 4000, "dur": 4000}, {"name": "optimizer.step", "ts": 9000, "dur": 50}]
    fitted = estimate_durations_from_timeline(events)
    assert fitted.duration(0, "F") == pytest.approx(0.002)
    assert fitted.duration(0, "B") == pytest.approx(0.004)


def test_runtime_chrome_events_and_action_objects_are_understood():
    class RuntimeAction:  # the shape of stages/train/timeline.py's Action (kind, stage, start_ns, end_ns)
        def __init__(self, kind, stage, start_ns, end_ns):
            self.kind, self.stage, self.start_ns, self.end_ns = kind, stage, start_ns, end_ns

    chrome = [{"name": "F0.s1", "ph": "X", "ts": 0.0, "dur": 500.0, "args": {"stage": 1, "kind": "F", "microbatch": 0}},
              {"name": "SEND_F0", "ph": "X", "ts": 0.0, "dur": 100.0, "args": {"stage": 1, "kind": "SEND_F"}},
              {"name": "step", "ph": "X", "ts": 0.0, "dur": 9e3, "args": {}}]
    fitted = estimate_durations_from_timeline(chrome + [RuntimeAction("F", 1, 0, 1_500_000)])
    assert fitted.duration(1, "F") == pytest.approx(0.001)  # mean of 0.5 ms and 1.5 ms
    assert fitted.p2p_s == pytest.approx(1e-4)


def test_a_timeline_without_actions_is_an_error():
    with pytest.raises(ValueError, match="no pipeline actions"):
        estimate_durations_from_timeline([{"name": "optimizer.step", "ts": 0, "dur": 5}])
    assert relative_error(110.0, 100.0) == pytest.approx(0.1)
