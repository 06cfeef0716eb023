"""The planner and the runtime answer layout questions alike: which layouts can run, how the layers
are split, where each stage lives and what each pipeline rank holds."""

from __future__ import annotations

import re

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from planner.config import ClusterConfig, PlanConfig, PlanConfigError, RolloutConfig, TrainConfig, WorkloadConfig
from planner.memory import estimate_stage_parameters
from planner.model import ModelShape
from planner.training import estimate_stage_layout
from flows.config import GRPOConfig
from stages.data import DatasetConfig
from stages.config import ConfigError, ModelConfig, RolloutConfig as RunRolloutConfig, TaskConfig
from stages.config import TrainConfig as RunTrainConfig
from stages.layout import SCHEDULES, ParallelLayout
from stages.policy import DecoderConfig, build_stage
from stages.train.engine import rank_tensor_names

_GROUP = 2  # samples per prompt; micro_batch_size = one group, so m microbatches = m prompts (dp = 1)


@st.composite
def _layouts(draw) -> dict[str, int | str]:
    # weighted towards layouts that pass the TP rules, so the schedule rules are reached often too
    kv = draw(st.sampled_from([1, 2, 4, 4, 3]))
    return dict(schedule=draw(st.sampled_from(SCHEDULES)), p=draw(st.integers(1, 5)), m=draw(st.integers(1, 12)),
                v=draw(st.sampled_from([1, 2, 2, 3])), layers=draw(st.integers(1, 12)), kv=kv,
                heads=kv * draw(st.integers(1, 3)), ffn=draw(st.sampled_from([24, 24, 12, 8, 5])),
                tp=draw(st.sampled_from([1, 1, 2, 2, 4, 3])))


def _runtime_error(x: dict) -> str | None:
    """The run config's verdict (GRPOConfig.__post_init__ -> _check_parallel_layout)."""
    try:
        GRPOConfig(
            task=TaskConfig(prompts_per_step=x["m"]), dataset=DatasetConfig(num_digits=1),
            model=ModelConfig(hidden_size=2 * x["heads"], intermediate_size=x["ffn"], num_hidden_layers=x["layers"],
                              num_attention_heads=x["heads"], num_key_value_heads=x["kv"]),
            rollout=RunRolloutConfig(group_size=_GROUP, max_new_tokens=1),
            train=RunTrainConfig(pipeline_model_parallel_size=x["p"], tensor_model_parallel_size=x["tp"],
                                 virtual_pipeline_model_parallel_size=x["v"], micro_batch_size=_GROUP,
                                 schedule=x["schedule"]))
    except ConfigError as exc:
        return str(exc)
    return None


def _planner_error(x: dict) -> str | None:
    """The plan config's verdict (PlanConfig.__post_init__ -> planner/validate.py), built without the run schema."""
    try:
        PlanConfig(
            model_shape=ModelShape(vocab_size=15, hidden_size=2 * x["heads"], intermediate_size=x["ffn"],
                                   num_hidden_layers=x["layers"], num_attention_heads=x["heads"],
                                   num_key_value_heads=x["kv"], head_dim=2),
            cluster=ClusterConfig(num_gpus=x["p"] * x["tp"], gpus_per_node=8),
            train=TrainConfig(tensor_model_parallel_size=x["tp"], pipeline_model_parallel_size=x["p"],
                              data_parallel_size=1, virtual_pipeline_model_parallel_size=x["v"],
                              micro_batch_size=_GROUP, schedule=x["schedule"]),
            workload=WorkloadConfig(prompts_per_step=x["m"], group_size=_GROUP, prompt_len=5, gen_len=1),
            rollout=RolloutConfig(rollout_tensor_parallel_size=1))
    except PlanConfigError as exc:
        return str(exc)
    return None


@settings(max_examples=400, deadline=None, derandomize=True)
@given(x=_layouts())
def test_planner_accepts_exactly_what_the_runtime_accepts(x):
    runtime, planner = _runtime_error(x), _planner_error(x)
    assert (runtime is None) == (planner is None), (x, runtime, planner)
    if runtime is not None:
        assert runtime == planner  # one rule, so one message naming the setting to change


@pytest.mark.parametrize("x, fragment", [
    (dict(schedule="1f1b", p=4, m=2, v=1), "needs at least train.pipeline_model_parallel_size=4 microbatches"),
    (dict(schedule="zb-h1", p=2, m=5, v=1), "multiple of 2 rounds"),
    (dict(schedule="1f1b", p=2, m=4, v=1, tp=4, heads=8, kv=2), "must divide model.num_key_value_heads=2"),
])
def test_cases_the_planner_used_to_accept_are_rejected_by_both(x, fragment):
    x = dict(dict(layers=8, kv=2, heads=4, ffn=16, tp=1), **x)
    assert fragment in _runtime_error(x) and fragment in _planner_error(x)


@pytest.mark.parametrize("schedule, p, v, layers, tied", [
    ("1f1b", 2, 1, 5, False), ("interleaved-1f1b", 2, 2, 7, True), ("zbv", 3, 2, 8, True),
    ("dualpipev", 2, 2, 4, False), ("gpipe", 1, 1, 3, True), ("zb-h1", 4, 1, 9, False)])
def test_planner_stage_layout_is_what_each_runtime_rank_builds(schedule, p, v, layers, tied):
    cfg = DecoderConfig(vocab_size=11, hidden_size=8, intermediate_size=12, num_hidden_layers=layers,
                        num_attention_heads=2, num_key_value_heads=1, head_dim=4, tie_word_embeddings=tied)
    shape = ModelShape(**{k: getattr(cfg, k) for k in ("vocab_size", "hidden_size", "intermediate_size",
                                                        "num_hidden_layers", "num_attention_heads",
                                                        "num_key_value_heads", "head_dim", "tie_word_embeddings")})
    planned = estimate_stage_layout(shape, TrainConfig(pipeline_model_parallel_size=p, tensor_model_parallel_size=1,
                                                       data_parallel_size=1, virtual_pipeline_model_parallel_size=v,
                                                       schedule=schedule), seq_len=8)
    layout = ParallelLayout(pp=p, virtual=v, schedule=schedule)
    assert planned.ranks == tuple(layout.stage_rank(s) for s in range(layout.num_stages))
    for rank in range(p):
        # layers the runtime loads for this rank, read off the HF tensor names it asks for
        names = rank_tensor_names(cfg, layout, rank)
        held = {int(n) for n in re.findall(r"model\.layers\.(\d+)\.", " ".join(names))}
        stages = [s for s, r in enumerate(planned.ranks) if r == rank]
        assert len(held) == sum(planned.layers[s] for s in stages)
    num_stages = layout.num_stages
    with torch.device("meta"):
        for s in range(num_stages):
            built = sum(t.numel() for t in build_stage(cfg, s, num_stages).parameters())
            planned_params = estimate_stage_parameters(shape, planned.layers[s], has_embedding=s == 0,
                                                       has_head=s == num_stages - 1, single_stage=num_stages == 1)
            assert built == planned_params, (s, built, planned_params)
