"""The asynchronous loop's rule and its event model (flows/async_schedule.py), and the config keys
that select it."""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from flows.async_schedule import (StepDurations, behaviour_version, released_by, simulate, staleness,
                                  trainer_version)
from flows.config import load_config
from flows.config import ConfigError
from stages.config import ASYNC_OFF_POLICY, effective_off_policy
from stages.config import OffPolicyConfig
from stages.policy import DecoderConfig
from stages.train.setup import train_setup


def test_rule_by_hand():
    # s = 2: steps 0, 1, 2 generate from v0; step 5 from v3, released by step 2's publish.
    assert [behaviour_version(k, 2) for k in range(6)] == [0, 0, 0, 1, 2, 3]
    assert [staleness(k, 2) for k in range(6)] == [0, 1, 2, 2, 2, 2]
    assert [released_by(k, 2) for k in range(6)] == [None, None, None, 0, 1, 2]
    assert [behaviour_version(k, 0) for k in range(4)] == [0, 1, 2, 3] == [trainer_version(k) for k in range(4)]
    with pytest.raises(ValueError):
        behaviour_version(-1, 0)


def test_simulated_sync_step_is_the_critical_path_sum():
    # s = 0: rollout 3 -> max(reward 1 + advantage 1, reference 2) -> train 4 -> publish 1 = 10 s a step.
    d = StepDurations(rollout=3, reward=1, reference=2, proximal=5, advantage=1, train=4, publish=1)
    ev = simulate([d] * 3, 0)
    assert [e.finished for e in ev] == [10, 20, 30]
    assert all(e.spans["proximal"][1] == e.spans["proximal"][0] for e in ev)  # no proximal stage at s = 0


def test_simulated_async_overlaps_rollout_and_train():
    # s = 1, decoupled: the engine generates step k+1 while the ranks train step k; the steady state
    # step is the slower side, reference 1 + proximal 1 + train 4 = 6 s against rollout 4 s.
    d = StepDurations(rollout=4, reference=1, proximal=1, train=4)
    ev = simulate([d] * 6, 1)
    gaps = [b.finished - a.finished for a, b in zip(ev, ev[1:])]
    assert gaps[-3:] == [6, 6, 6]
    assert ev[1].spans["rollout"] == (4, 8)  # step 1 starts at once from v0, behind step 0 on the engine


durations = st.builds(StepDurations, *[st.floats(0.0, 10.0, allow_nan=False)] * 7)


@settings(max_examples=100, deadline=None)
@given(st.lists(durations, min_size=1, max_size=12), st.integers(0, 4), st.booleans())
def test_staleness_bound_holds_for_any_durations(steps, s, colocated):
    ev = simulate(steps, s, colocated)
    for e in ev:
        assert 0 <= e.trainer_version - e.behaviour_version <= s
        if s == 0:
            assert e.behaviour_version == e.trainer_version
        # The version a step generates from was published before its rollout started.
        assert e.behaviour_version in e.published_at
        # The step's train starts after the previous step's train (one order on every rank).
        if e.step:
            assert e.spans["train"][0] >= ev[e.step - 1].spans["train"][1]
    # Steps in flight: step k is submitted only once step k - s - 2 finished (its rollout waits on
    # step k - s - 1's publish, checked above).
    for e in ev:
        for other in ev:
            if other.step < e.step - s - 1:
                assert other.finished <= e.submitted


def test_config_keys(tmp_path):
    cfg = load_config("configs/tiny.yaml", ["rollout.max_staleness=2", "cluster.placement=colocated",
                                            "cluster.rollout_threads=2"])
    assert cfg.rollout.max_staleness == 2 and cfg.cluster.colocated_pools and cfg.cluster.rollout_threads == 2
    assert effective_off_policy(cfg.train, 2) == ASYNC_OFF_POLICY
    assert ASYNC_OFF_POLICY.decoupled and ASYNC_OFF_POLICY.is_mode == "truncate" and ASYNC_OFF_POLICY.is_cap == 2.0
    assert effective_off_policy(cfg.train, 0) == OffPolicyConfig()
    # vLLM's log-probs are not the trainer's own: TIS weights its tokens by the mismatch, at s = 0 too.
    assert effective_off_policy(cfg.train, 0, "vllm") == ASYNC_OFF_POLICY
    # Nor are they in bfloat16, on either side: the same loss at s = 0, unless train.off_policy is set.
    assert effective_off_policy(cfg.train, 0, "native", "bfloat16") == ASYNC_OFF_POLICY
    for overrides, engine_dtype in ((["train.dtype=bfloat16"], "float32"), (["rollout.dtype=bfloat16"], "bfloat16"),
                                    (["rollout.device=cuda"], "bfloat16")):  # auto on CUDA: bfloat16
        bf16 = load_config("configs/tiny.yaml", overrides)
        assert bf16.engine_dtype == engine_dtype and bf16.off_policy == ASYNC_OFF_POLICY, overrides
    plain = load_config("configs/tiny.yaml", ["rollout.device=cpu"])
    assert plain.engine_dtype == "float32" and plain.off_policy == OffPolicyConfig()
    shape = plain.model.shape(32)  # the training ranks' loss (flows/tasks.py) takes the same section
    model = DecoderConfig(**{k: getattr(shape, k) for k in shape.__dataclass_fields__})
    assert train_setup(plain.train, model, 2, 1.0).loss.off_policy == OffPolicyConfig()
    assert train_setup(plain.train, model, 2, 1.0, engine_dtype="bfloat16").loss.off_policy == ASYNC_OFF_POLICY
    assert load_config("configs/tiny.yaml", ["train.dtype=bfloat16", "train.off_policy.is_mode=mask"]).off_policy \
        == OffPolicyConfig(is_mode="mask")
    mine = load_config("configs/tiny.yaml", ["train.off_policy.is_mode=mask"]).train
    assert effective_off_policy(mine, 1).is_mode == "mask" and not effective_off_policy(mine, 1).decoupled
    with pytest.raises(ConfigError, match="cluster.placement=colocated instead"):
        load_config("configs/tiny.yaml", ["cluster.colocated=true"])
    with pytest.raises(ConfigError, match="cluster.placement"):
        load_config("configs/tiny.yaml", ["cluster.placement=split"])
    with pytest.raises(ConfigError, match="rollout.max_staleness"):
        load_config("configs/tiny.yaml", ["rollout.max_staleness=-1"])


def test_schema_stays_torch_free():
    import subprocess
    import sys

    code = "import sys, flows.config, flows.async_schedule; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"


@settings(max_examples=150, deadline=None)
@given(st.builds(StepDurations, *[st.integers(0, 20).map(float)] * 7), st.integers(0, 3), st.booleans(),
       st.booleans(), st.booleans())
def test_planner_closed_form_matches_the_event_model(d, s, colocated, reward_in_rollout, reference_in_train):
    from planner.async_steptime import StageSeconds, async_step_seconds

    graph = dict(reward_in_rollout=reward_in_rollout, reference_in_train=reference_in_train)
    ev = simulate([d] * 72, s, colocated, **graph)
    m = 12  # a multiple of every period 1 .. s + 1 the steady state can have
    measured = (ev[-1].finished - ev[-1 - m].finished) / m
    t = StageSeconds(rollout=d.rollout, reward=d.reward, reference=d.reference, advantage=d.advantage,
                     train=d.train, publish=d.publish, proximal=d.proximal, **graph)
    assert async_step_seconds(t, s, colocated) == pytest.approx(measured, abs=1e-9)


def test_planner_by_hand():
    from planner.async_steptime import StageSeconds, async_step_seconds, sync_step_seconds

    # rollout 4, reward + advantage 1, reference 1 (proximal too), train 3, publish 0.5, loop 0.5:
    # sync 4 + 1 + 3 + 0.5 + 0.5 = 9; s = 1: max(4, 1 + 1 + 3 = 5, (4 + 2 + 3 + 1) / 2 = 5) = 5.
    t = StageSeconds(rollout=4, reward=0.5, reference=1, advantage=0.5, train=3, publish=0.5, loop=0.5)
    assert sync_step_seconds(t) == 9 and async_step_seconds(t, 0) == 9
    assert async_step_seconds(t, 1) == 5 and async_step_seconds(t, 2) == 5
    assert async_step_seconds(t, 1, colocated=True) == 4 + 1 + 1 + 3
    # The host's terms: hand-offs lengthen the training chain 1 + 1 + 3 + 2 * 0.5 = 6 > 5; a step
    # costing 13 CPU seconds on 2 cores cannot run faster than 6.5; the sync prediction is unchanged.
    host = StageSeconds(rollout=4, reward=0.5, reference=1, advantage=0.5, train=3, publish=0.5, loop=0.5, handoff=0.5)
    assert async_step_seconds(host, 1) == 6 and sync_step_seconds(host) == 9
    busy = StageSeconds(rollout=4, reward=0.5, reference=1, advantage=0.5, train=3, publish=0.5, loop=0.5,
                        host_cpu=13, cores=2)
    assert async_step_seconds(busy, 1) == 6.5 and async_step_seconds(busy, 0) == 9
    with pytest.raises(ValueError, match="cores"):
        StageSeconds(rollout=4, reward=0.5, reference=1, advantage=0.5, train=3, publish=0.5, host_cpu=13)
    # The engine scores (reward 0.5 after its 4) and the train task runs the reference; the
    # advantage gate (0.5) runs beside the train task. Sync 4.5 + max(0.5, 1 + 3) + 0.5 + 0.5 = 9.5;
    # a gate longer than the passes holds publish back: 4.5 + 6 + 0.5 + 0.5 = 11.5. s = 1, the
    # proximal task (1) marks itself, so it waits for the gate: max(engine 4.5, chain 1 + 1 + 3 = 5,
    # cycle (4.5 + (0.5 + 1) + 1 + 3 + 0.5 + 0.5) / 2 = 5.5) = 5.5.
    inside = dataclasses.replace(t, reward_in_rollout=True, reference_in_train=True)
    assert sync_step_seconds(inside) == 9.5 and async_step_seconds(inside, 1) == 5.5
    assert sync_step_seconds(dataclasses.replace(inside, advantage=6)) == 11.5
    # A reference task of its own waits for the gate too: sync 4.5 + (0.5 + 1) + 3 + 0.5 + 0.5 = 10.
    assert sync_step_seconds(dataclasses.replace(inside, reference_in_train=False)) == 10
    fused = dataclasses.replace(host, reference_in_train=True, proximal=0.0)
    assert async_step_seconds(fused, 1) == max(4, 1 + 3 + 0.5, (4 + 1 + 1 + 3 + 1) / 2)


def test_host_cpu_counts_this_process_and_the_processes_it_started():
    import select
    import subprocess
    import sys

    from flows.loop import _HostCPU

    meter = _HostCPU()
    # The child burns 0.5 CPU-s, says so, then sleeps: both takes come after its burning has ended,
    # so the second sees only what was spent between them. psutil reads the kernel's tick-rounded
    # times, hence 0.4 for the 0.5 spent.
    burn = ("import time\nt = time.process_time()\nwhile time.process_time() - t < 0.5: pass\n"
            "print('burnt', flush=True)\ntime.sleep(30)")
    child = subprocess.Popen([sys.executable, "-c", burn], stdout=subprocess.PIPE, text=True)
    try:
        ready, _, _ = select.select([child.stdout], [], [], 30)
        assert ready and child.stdout.readline().strip() == "burnt", "the child did not finish burning within 30 s"
        assert meter.take() >= 0.4  # the child's CPU, counted from its start
        assert meter.take() < 0.2  # the next take: only what was spent since
    finally:
        child.kill()
        child.wait()
