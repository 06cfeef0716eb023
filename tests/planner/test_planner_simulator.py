"""The discrete-event simulator: hand-worked timelines, measured means, group barriers, extrapolation."""

import dataclasses

import pytest

from planner.schedules import Action, PipelineOrder
from planner.simulator import (
    ActionDurations,
    ScheduleDeadlockError,
    simulate_peak_stash_bytes,
    simulate_pipeline_order,
    simulate_schedule,
)
from planner.training import estimate_train_step
from planner_factories import make_plan_config


def test_two_stage_1f1b_with_transfers_by_hand():
    # F=1, B=2, p2p=0.5. rank1: F0 1.5-2.5, B0 2.5-4.5, F1 4.5-5.5, B1 5.5-7.5
    # rank0: F0 0-1, F1 1-2, B0 (4.5+0.5) 5-7, B1 (7.5+0.5) 8-10
    durations = ActionDurations(forward_s=1, backward_input_s=1, backward_weight_s=1, p2p_s=0.5)
    sim = simulate_schedule("1f1b", 2, 2, 1, durations)
    assert sim.makespan_s == 10.0
    assert sim.busy_s == (6.0, 6.0)
    assert sim.bubble_fraction == pytest.approx(0.4)
    ends = {(e.rank, e.kind, e.microbatch): (e.start_s, e.end_s) for e in sim.events}
    assert ends[1, "F", 1] == (4.5, 5.5) and ends[0, "B", 1] == (8.0, 10.0)


def test_measured_means_per_stage_and_kind_drive_the_timeline():
    # a slow last stage (F 3, B 6) dominates: the steady state advances 9 s per microbatch
    means = {(0, "F"): 1.0, (0, "B"): 2.0, (1, "F"): 3.0, (1, "B"): 6.0}
    sim = simulate_schedule("1f1b", 2, 4, 1, means)
    assert sim.makespan_s == 1 + 4 * 9 + 2
    assert sim.busy_s == (12.0, 36.0)


def test_means_with_only_b_split_into_equal_i_and_w():
    durations = ActionDurations.from_means({(0, "F"): 1.0, (0, "B"): 4.0})
    assert durations.duration(0, "I") == durations.duration(0, "W") == 2.0
    assert ActionDurations.from_means({(0, "I"): 1.0, (0, "W"): 3.0}).duration(0, "B") == 4.0
    with pytest.raises(ValueError, match="kind"):
        ActionDurations.from_means({(0, "X"): 1.0})
    with pytest.raises(ValueError, match="no duration"):
        ActionDurations.from_means({(0, "W"): 1.0}).duration(0, "F")


def test_group_barrier_adds_k_minus_1_in_flight_microbatches_per_stage():
    p, m, k = 4, 16, 4
    sim = simulate_schedule("1f1b", p, m, 1, loss_group_microbatches=k)
    assert sim.peak_in_flight_per_stage == tuple(p - i + k - 1 for i in range(p))
    with pytest.raises(ValueError, match="gpipe and 1f1b"):
        simulate_schedule("zbv", p, m, 2, loss_group_microbatches=2)


def test_stash_bytes_weight_each_stage_by_its_in_flight_count():
    sim = simulate_schedule("1f1b", 3, 6, 1)
    assert simulate_peak_stash_bytes(sim, {0: 10.0, 1: 20.0, 2: 40.0}) == (30.0, 40.0, 40.0)


def test_an_impossible_order_is_reported_not_hung():
    order = PipelineOrder("1f1b", 2, 1, 1, (0, 1), ((Action("B", 0, 0), Action("F", 0, 0)),
                                                    (Action("F", 1, 0), Action("B", 1, 0))))
    with pytest.raises(ScheduleDeadlockError, match="no rank can proceed"):
        simulate_pipeline_order(order, ActionDurations())


@pytest.mark.parametrize(("schedule", "v"), [("1f1b", 1), ("interleaved-1f1b", 2), ("zb-h1", 1), ("zbv", 2),
                                             ("dualpipev", 2)])
def test_extrapolated_step_matches_the_full_simulation(schedule, v):
    cfg = make_plan_config(workload={"prompts_per_step": 64},
                           train={"schedule": schedule, "virtual_pipeline_model_parallel_size": v})
    full = estimate_train_step(cfg)
    short = estimate_train_step(cfg, max_simulated_microbatches=1)
    assert short.simulated_microbatches < full.simulated_microbatches == cfg.num_microbatches
    assert short.pipeline_s == pytest.approx(full.pipeline_s, rel=2e-3)


def test_simulation_is_deterministic_and_events_can_be_dropped():
    a = simulate_schedule("zbv", 4, 9, 2)
    b = simulate_schedule("zbv", 4, 9, 2, keep_events=False)
    assert a.makespan_s == b.makespan_s and a.in_flight_profiles == b.in_flight_profiles
    assert b.events == () and len(a.events) == 3 * 4 * 2 * 9
    assert dataclasses.replace(a, events=()).bubble_fraction == a.bubble_fraction
