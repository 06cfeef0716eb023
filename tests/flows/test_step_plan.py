"""A step's graph as a plan (flows/iteration.py ``plan_step``), without Dask: which tasks each
configuration gets, what each waits on, and that their keys change with the rerun number only.
Submitting a plan is what every run does (tests/flows/test_e2e.py and the runs it compares)."""

from __future__ import annotations

import pytest

from flows import tasks
from flows.cluster import Pools
from flows.config import load_config
from flows.iteration import Dep, StepPlan, plan_step, step_layout, step_stages
from storage.policies import PolicyRef
from storage.rollouts import StepRef
from storage.run_folder import RunFolder

POOLS = Pools(train=("train-0", "train-1"), rollout=("rollout-0", "rollout-1"), plain=("plain-0",),
              addresses=(("train-0", "tcp://10.0.0.1:1"), ("train-1", "tcp://10.0.0.2:1"),
                         ("rollout-0", "tcp://10.0.0.3:1"), ("rollout-1", "tcp://10.0.0.4:1"),
                         ("plain-0", "tcp://10.0.0.5:1")))
SEPARATE = ["reward.in_rollout=false", "train.reference_pass=separate"]


def _plan(tmp_path, overrides=(), done=(), attempt=0, prev_train=()) -> StepPlan:
    cfg = load_config("configs/tiny.yaml", [*overrides, f"runs_dir={tmp_path}"])
    policy = PolicyRef(str(tmp_path / "policy" / "v3"), 3, "ab" * 32)
    return plan_step(cfg, POOLS, RunFolder.at(tmp_path, "r"), StepRef(str(tmp_path / "rollouts.zarr"), 3),
                     step_layout(cfg), policy, done, prev_train, attempt)


def _deps(x) -> set[str]:
    if isinstance(x, Dep):
        return {x.key}
    if type(x) in (tuple, list):
        return set().union(*map(_deps, x)) if x else set()
    return set()


def _by_fn(plan: StepPlan) -> dict[str, list]:
    """Task keys by the stage function they run (a run_and_mark task by the function it wraps)."""
    out: dict[str, list] = {}
    for t in plan.tasks:
        fn = t.args[0] if t.fn is tasks.run_and_mark else t.fn
        out.setdefault(fn.__name__, []).append(t)
    return out


def test_every_task_waits_only_on_tasks_submitted_before_it(tmp_path):
    for overrides in ([], SEPARATE, ["train.kl_beta=0"], ["rollout.max_staleness=1", "train.off_policy.decoupled=true",
                                                          "train.off_policy.proximal=pass", *SEPARATE]):
        plan = _plan(tmp_path, overrides)
        seen: set[str] = set()
        for t in plan.tasks:
            assert _deps(t.args) <= seen, (overrides, t.key)
            assert t.key not in seen
            seen.add(t.key)
        assert tuple(plan.stages) == step_stages(load_config("configs/tiny.yaml", overrides))


def test_separate_stages_wait_as_the_diagram_says(tmp_path):
    plan = _plan(tmp_path, SEPARATE)
    fns = _by_fn(plan)
    rollout = plan.stages["rollout"]
    assert len(rollout.work) == 2 and rollout.gate.key.startswith("rollout-done-")  # two engines, one gate
    scores = fns["score_task"]
    assert len(scores) == 2 and all(_deps(t.args) == {rollout.gate.key} for t in scores)
    reward_gate = plan.stages["reward"].gate
    assert plan.stages["advantage"].gate == reward_gate  # scoring writes rewards and advantages
    refs = fns["reference_task"]
    assert [t.options["workers"] for t in refs] == [["tcp://10.0.0.1:1"], ["tcp://10.0.0.2:1"]]  # pinned by rank
    assert all(_deps(t.args) == {rollout.gate.key} for t in refs)
    out = plan.stages["reference"].gate.key
    assert out == refs[1].key  # the output rank's task marks the pass
    trains = fns["train_task"]
    for r, t in enumerate(trains):  # the advantages, the pass's output and the rank's own share of it
        assert _deps(t.args) == {rollout.gate.key, reward_gate.key, out, refs[r].key}
    (publish,) = fns["publish_task"]
    assert _deps(publish.args) == {t.key for t in trains}
    assert plan.stages["train"].gate.key == publish.key and plan.stages["train"].marked_by_next


def test_scoring_in_rollout_and_the_fused_reference_add_no_tasks_of_their_own(tmp_path):
    plan = _plan(tmp_path)  # the tiny config: reward.in_rollout, train.reference_pass=fused
    fns = _by_fn(plan)
    assert "score_task" not in fns and "reference_task" not in fns
    assert plan.stages["reward"].inside == "rollout" and plan.stages["reference"].inside == "train"
    (scored,) = fns["mark_scored"]
    rollouts = {t.key for t in fns["rollout_task"]}
    assert _deps(scored.args) == rollouts
    assert all(_deps(t.args) == rollouts for t in fns["train_task"])  # the rows, beside the scoring gate
    (publish,) = fns["publish_task"]
    assert scored.key in _deps(publish.args)  # nothing is marked before the scores


def test_no_reference_pass_without_a_kl_term(tmp_path):
    plan = _plan(tmp_path, [*SEPARATE, "train.kl_beta=0"])
    assert "reference" not in plan.stages and "reference_task" not in _by_fn(plan)


def test_a_resumed_step_plans_only_what_is_not_done(tmp_path):
    plan = _plan(tmp_path, SEPARATE, done={"rollout", "reward", "advantage"}, prev_train=("prev",))
    fns = _by_fn(plan)
    assert set(fns) == {"reference_task", "train_task", "publish_task"}
    assert plan.stages["rollout"].gate is None and plan.stages["reward"].work == ()
    for t in fns["train_task"] + fns["reference_task"]:
        assert "prev" in t.args  # the previous step's train gate, passed through as given


def test_keys_depend_on_the_attempt_and_nothing_else(tmp_path):
    keys = [[t.key for t in _plan(tmp_path, SEPARATE, attempt=a).tasks] for a in (0, 0, 1)]
    assert keys[0] == keys[1]
    assert not set(keys[0]) & set(keys[2]) and len(keys[0]) == len(keys[2])


@pytest.mark.parametrize("num_tasks", [1, 3])
def test_scoring_tasks_cover_the_groups_in_chunk_aligned_ranges(tmp_path, num_tasks):
    plan = _plan(tmp_path, [*SEPARATE, f"reward.num_tasks={num_tasks}"])
    tiny = load_config("configs/tiny.yaml")
    G, prompts = tiny.rollout.group_size, tiny.task.prompts_per_step
    scores = _by_fn(plan)["score_task"]
    ranges = [(t.args[7], t.args[8]) if t.fn is tasks.run_and_mark else (t.args[3], t.args[4]) for t in scores]
    assert len(ranges) == num_tasks and ranges[0][0] == 0 and ranges[-1][1] == prompts * G
    assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))
    assert (plan.stages["reward"].gate.key == scores[0].key) == (num_tasks == 1)  # one task marks itself
