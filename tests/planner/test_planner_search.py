"""Layout search: feasible layouts fastest first, a reason for every rejected one."""

import pytest

from planner.search import search_layouts
from planner_factories import make_plan_config


@pytest.fixture(scope="module")
def result():
    # Llama-3-8B on 16 x 24 GiB with Megatron/TE accounting: small enough that memory rejects many layouts
    # and leaves decoupled splits in, fast enough to search
    return search_layouts(make_plan_config(cluster={"gpu_memory_gib": 24.0}, search={"enabled": True},
                                           train={"activation_impl": "megatron-te", "tp_rules": "megatron"}))


def test_feasible_layouts_fit_and_come_fastest_first(result):
    assert result.feasible, "expected at least one layout to fit"
    cap = result.feasible[0].config.cluster.memory_cap_bytes
    times = [c.step_s for c in result.feasible]
    assert times == sorted(times)
    for cand in result.feasible:
        assert cand.estimate.rejection is None
        assert cand.estimate.peak_training_bytes <= cap
        assert cand.estimate.rollout.feasible
    assert result.evaluated == len(result.feasible) + len(result.rejected)


def test_every_rejection_has_a_kind_and_a_reason(result):
    kinds = result.rejection_counts
    assert {"constraint", "memory", "static-memory", "dominated"} <= set(kinds)
    for rej in result.rejected:
        assert rej.reason and "\n" not in rej.reason
    memory = [r for r in result.rejected if r.kind == "memory"]
    assert all("exceeds the" in r.reason and "cap by" in r.reason for r in memory)
    assert [r.overage for r in memory] == sorted(r.overage for r in memory)  # near misses first


def test_a_layout_that_cannot_hold_its_weights_is_rejected_as_static(result):
    static = {r.label.split(" |")[0] for r in result.rejected if r.kind == "static-memory"}
    # TP1 PP1 DP16: 8B params x 18 B (bf16 weights, fp32 grads, Adam / 16) = 150 GB per GPU
    assert any(label.startswith("TP1 PP1 DP16") for label in static)


def test_best_by_split_covers_colocated_and_decoupled(result):
    sync, async_ = result.best_by_split(0), result.best_by_split(1)
    assert ("colocated", 16) in sync
    decoupled = [k for k in async_ if k[0] == "decoupled"]
    assert decoupled
    for key in decoupled:
        assert async_[key].step_s_async <= sync[key].step_s_sync
