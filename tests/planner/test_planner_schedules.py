"""Schedules: closed-form bubbles reproduced exactly by simulating each schedule's own order."""

from collections import Counter

import pytest

from planner.schedules import (
    SCHEDULES,
    bubble_fraction_1f1b,
    bubble_fraction_gpipe,
    bubble_fraction_interleaved,
    build_pipeline_order,
    idle_time_zb_h1,
)
from planner.simulator import ActionDurations, simulate_schedule
from stages.layout import schedule_error, stage_to_rank

GRID_P = (2, 3, 4, 8)
GRID_M = (1, 2, 3, 5, 8, 16, 24)


def _skip_unless_torch_runs(schedule: str, p: int, m: int, v: int = 1) -> None:
    """Orders exist only for what torch runs (e.g. 1F1B needs m >= p): the grid skips the rest."""
    if schedule_error(schedule, p, m, v) is not None:
        pytest.skip(f"torch does not run {schedule} with p={p}, m={m}, v={v}")


def _uniform(v: int = 1, f: float = 1.0, i: float = 1.0, w: float = 1.0) -> ActionDurations:
    return ActionDurations(forward_s=f / v, backward_input_s=i / v, backward_weight_s=w / v)


@pytest.mark.parametrize("p", GRID_P)
@pytest.mark.parametrize("m", GRID_M)
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_gpipe_and_1f1b_bubble_is_p_minus_1_over_m_plus_p_minus_1(schedule, p, m):
    _skip_unless_torch_runs(schedule, p, m)
    sim = simulate_schedule(schedule, p, m, 1, _uniform(f=1.0, i=1.0, w=1.0))
    expected = (p - 1) / (m + p - 1)
    assert sim.bubble_fraction == pytest.approx(expected, abs=1e-12)
    assert all(b == pytest.approx(expected, abs=1e-12) for b in sim.bubble_fraction_per_rank)
    assert bubble_fraction_gpipe(p, m) == bubble_fraction_1f1b(p, m) == expected


@pytest.mark.parametrize("p", GRID_P)
@pytest.mark.parametrize("v", (2, 3, 4))
@pytest.mark.parametrize("rounds", (1, 2, 3))
def test_interleaved_bubble_is_p_minus_1_over_vm_plus_p_minus_1(p, v, rounds):
    m = rounds * p  # Narayanan et al.'s condition m % p == 0
    sim = simulate_schedule("interleaved-1f1b", p, m, v, _uniform(v))
    assert sim.bubble_fraction == pytest.approx((p - 1) / (v * m + p - 1), abs=1e-12)
    assert bubble_fraction_interleaved(p, m, v) == (p - 1) / (v * m + p - 1)


@pytest.mark.parametrize("p", GRID_P)
@pytest.mark.parametrize("extra", (0, 1, 5, 24))
@pytest.mark.parametrize(("f", "i", "w"), [(1.0, 1.0, 1.0), (1.0, 1.5, 0.5), (1.0, 2.0, 1.0), (2.0, 1.0, 0.5)])
def test_zb_h1_idles_p_minus_1_times_f_plus_b_minus_w_per_rank(p, extra, f, i, w):
    m = p + extra  # the paper's regime: m >= p and T_W <= T_F
    _skip_unless_torch_runs("zb-h1", p, m)
    sim = simulate_schedule("zb-h1", p, m, 1, ActionDurations(forward_s=f, backward_input_s=i, backward_weight_s=w))
    expected = idle_time_zb_h1(p, f, i, w)  # (p-1)(T_F + T_B - T_W), T_B the input backward
    assert all(idle == pytest.approx(expected, abs=1e-9) for idle in sim.idle_s)


@pytest.mark.parametrize("p", GRID_P)
@pytest.mark.parametrize("m", GRID_M)
def test_1f1b_stage_i_peaks_at_min_m_p_minus_i_and_gpipe_at_m(p, m):
    if m >= p:  # torch runs 1F1B only with m >= p
        one = simulate_schedule("1f1b", p, m, 1)
        assert one.peak_in_flight_per_stage == tuple(min(m, p - i) for i in range(p))
    assert simulate_schedule("gpipe", p, m, 1).peak_in_flight_per_stage == (m,) * p


@pytest.mark.parametrize(("schedule", "v"), [("gpipe", 1), ("1f1b", 1), ("interleaved-1f1b", 2),
                                             ("interleaved-1f1b", 4), ("zb-h1", 1), ("zbv", 2), ("dualpipev", 2)])
@pytest.mark.parametrize("p", (2, 4, 8))
def test_every_order_runs_each_action_exactly_once_on_its_rank(schedule, v, p):
    m = 2 * p
    order = build_pipeline_order(schedule, p, m, v)
    ranks = stage_to_rank(schedule, p, v)
    seen = Counter()
    for rank, actions in enumerate(order.rank_actions):
        for a in actions:
            assert ranks[a.stage] == rank
            seen[a.stage, a.microbatch, "W" if a.kind == "W" else ("F" if a.kind == "F" else "BI")] += 1
            if a.kind == "B":
                seen[a.stage, a.microbatch, "W"] += 1
    assert set(seen.values()) == {1}
    assert len(seen) == 3 * p * v * m
    simulate_schedule(schedule, p, m, v)  # completes without deadlock


@pytest.mark.parametrize("p", (2, 4, 8))
def test_v_schedules_beat_1f1b_on_equal_work(p):
    m = 4 * p
    base = simulate_schedule("1f1b", p, m, 1).makespan_s
    for schedule in ("zbv", "dualpipev"):
        assert simulate_schedule(schedule, p, m, 2, _uniform(2)).makespan_s < base


def test_v_placement_puts_first_and_last_stage_on_rank_0():
    assert stage_to_rank("zbv", 4, 2) == (0, 1, 2, 3, 3, 2, 1, 0)
    assert stage_to_rank("interleaved-1f1b", 4, 2) == (0, 1, 2, 3, 0, 1, 2, 3)


@pytest.mark.parametrize(("args", "fragment"), [
    (("1f1b", 4, 8, 2), "virtual_pipeline_model_parallel_size=1"),
    (("zbv", 4, 8, 1), "exactly two stages"),
    (("interleaved-1f1b", 4, 8, 1), ">= 2"),
    (("interleaved-1f1b", 4, 9, 2), "multiple"),
    (("dualpipev", 4, 7, 2), "at least 2 x train.pipeline_model_parallel_size = 8"),
    (("1f1b", 4, 2, 1), "needs at least train.pipeline_model_parallel_size=4 microbatches"),
    (("zb-h1", 2, 5, 1), "multiple of 2 rounds"),
    (("pipedream", 4, 8, 1), "is not one of"),
])
def test_constraint_errors_say_what_to_change(args, fragment):
    assert fragment in schedule_error(*args)
    with pytest.raises(ValueError, match="."):
        build_pipeline_order(*args)


def test_all_schedules_are_listed():
    assert set(SCHEDULES) == {"gpipe", "1f1b", "interleaved-1f1b", "zb-h1", "zbv", "dualpipev"}
