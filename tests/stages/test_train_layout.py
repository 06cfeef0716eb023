"""The (pp, dp, tp) layout, stage placement and schedule constraints: arithmetic worked out by hand,
and config errors in one line naming the setting to change."""

from __future__ import annotations

import pytest

from flows.config import load_config
from stages.config import ConfigError
from stages.layout import (SCHEDULES, MeshCoord, ModelShape, ParallelLayout, layers_per_stage, schedule_error,
                           shape_from_hf)
from stages.train.timeline import Action, bubble_fraction

# The tiny config at the size these checks were worked out for: 16 prompts x G 8 = 128 samples.
SMALL = ["task.prompts_per_step=16", "train.micro_batch_size=32"]


def test_global_rank_puts_tensor_parallel_fastest():
    layout = ParallelLayout(pp=2, dp=2, tp=2)
    assert [layout.coord(r) for r in (0, 1, 2, 5, 7)] == [
        MeshCoord(0, 0, 0), MeshCoord(0, 0, 1), MeshCoord(0, 1, 0), MeshCoord(1, 0, 1), MeshCoord(1, 1, 1)]
    assert all(layout.rank_of(layout.coord(r)) == r for r in range(8))
    assert layout.axis_groups("tp") == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert layout.axis_groups("dp") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert layout.axis_groups("pp") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    with pytest.raises(ValueError, match="outside a world of 8"):
        layout.coord(8)


def test_stage_placement_looped_and_v_shaped():
    looped = ParallelLayout(pp=4, virtual=2, schedule="interleaved-1f1b")
    assert [looped.stages_of(r) for r in range(4)] == [(0, 4), (1, 5), (2, 6), (3, 7)]
    v = ParallelLayout(pp=4, virtual=2, schedule="zbv")
    assert [v.stages_of(r) for r in range(4)] == [(0, 7), (1, 6), (2, 5), (3, 4)]
    # tied embedding: rank 0 holds both copies under a V, ranks 0 and 3 (per dp, tp) otherwise
    assert v.tied_groups() == []
    assert ParallelLayout(pp=4, dp=2, schedule="1f1b").tied_groups() == [[0, 6], [1, 7]]


def test_output_rank_holds_the_last_stage_at_dp_and_tp_zero():
    # pp 2 x dp 2 x tp 2, looped: the last stage is on pipeline rank 1; (pp 1, dp 0, tp 0) = rank 4.
    assert ParallelLayout(pp=2, dp=2, tp=2).output_rank == 4
    # looped interleaving, pp 4 x v 2 x dp 2: stage 7 on pipeline rank 3 -> (3, 0, 0) = rank 6.
    assert ParallelLayout(pp=4, dp=2, virtual=2, schedule="interleaved-1f1b").output_rank == 6
    # a V ends where it starts: pipeline rank 0.
    assert ParallelLayout(pp=4, dp=2, virtual=2, schedule="zbv").output_rank == 0
    assert ParallelLayout().output_rank == 0


@pytest.mark.parametrize("schedule, p, m, v, fragment", [
    ("1f1b", 4, 3, 1, "needs at least train.pipeline_model_parallel_size=4 microbatches"),
    ("gpipe", 2, 4, 2, "set train.virtual_pipeline_model_parallel_size=1"),
    ("zbv", 2, 4, 1, "set train.virtual_pipeline_model_parallel_size=2"),
    ("dualpipev", 2, 3, 2, "at least 2 x train.pipeline_model_parallel_size = 4 microbatches"),
    ("interleaved-1f1b", 2, 4, 1, "train.virtual_pipeline_model_parallel_size >= 2"),
    ("interleaved-1f1b", 4, 10, 2, None),  # torch's flexible rounds: 10 % (10 // 4) == 0
    ("interleaved-1f1b", 4, 9, 2, "multiple of 2 rounds"),
    ("zb-h1", 2, 4, 1, None),
    ("zbv", 2, 1, 2, None),
])
def test_schedule_constraints(schedule, p, m, v, fragment):
    error = schedule_error(schedule, p, m, v, num_layers=8)
    if fragment is None:
        assert error is None
    else:
        assert fragment in error and "\n" not in error


def test_layers_must_cover_every_stage():
    assert "cannot be split into" in schedule_error("zbv", 4, 8, 2, num_layers=6)


@pytest.mark.parametrize("overrides, key", [
    (["train.schedule=zbv"], "train.virtual_pipeline_model_parallel_size=2"),
    (["train.schedule=interleaved-1f1b", "train.virtual_pipeline_model_parallel_size=4"],
     "model.num_hidden_layers=4"),
    (["train.data_parallel_size=3"], "train.data_parallel_size=3"),
    # One microbatch's budget holds every group: 1 per replica after rounding up to dp = 2 < pp.
    (["train.data_parallel_size=2", "train.micro_batch_size=128"], "train.micro_batch_size"),
    (["train.tensor_model_parallel_size=4"], "model.num_key_value_heads=2"),
    (["train.schedule=dualpipev", "train.virtual_pipeline_model_parallel_size=2", "train.micro_batch_size=64"],
     "train.micro_batch_size"),
    (["train.virtual_pipeline_model_parallel_size=0"], "train.virtual_pipeline_model_parallel_size=0"),
    (["train.tensor_model_parallel_size=2", "train.reference_parallel=data"], "train.reference_parallel=pipeline"),
    (["train.reference_parallel=replicated"],
     "train.reference_parallel='replicated' is not one of auto, pipeline, data"),
    (["train.keep_optimizer_state=none"], "train.keep_optimizer_state='none' is not one of latest, all"),
])
def test_config_rejects_a_layout_in_one_line(overrides, key):
    with pytest.raises(ConfigError) as info:
        load_config("configs/tiny.yaml", [*SMALL, *overrides])
    assert key in str(info.value) and "\n" not in str(info.value)


def test_reference_parallel_auto_follows_the_tensor_split():
    """auto holds the whole (small) reference on every rank at TP 1, and pipelines it at TP > 1,
    so pp 2 x tp 2 x dp 2 needs no extra flag."""
    assert load_config("configs/tiny.yaml", SMALL).reference_parallel == "data"
    layout = ["train.tensor_model_parallel_size=2", "train.data_parallel_size=2"]
    assert load_config("configs/tiny.yaml", [*SMALL, *layout]).reference_parallel == "pipeline"
    explicit = ["train.reference_parallel=pipeline"]
    assert load_config("configs/tiny.yaml", [*SMALL, *explicit]).reference_parallel == "pipeline"


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_tiny_config_runs_every_schedule(schedule):
    v = 2 if schedule in ("interleaved-1f1b", "zbv", "dualpipev") else 1
    cfg = load_config("configs/tiny.yaml", [*SMALL, f"train.schedule={schedule}",
                                            f"train.virtual_pipeline_model_parallel_size={v}"])
    assert cfg.num_microbatches == 4


def test_3d_layout_config():
    cfg = load_config("configs/tiny.yaml", [*SMALL, "train.data_parallel_size=2", "train.tensor_model_parallel_size=2",
                                            "train.reference_parallel=pipeline"])
    assert cfg.train.world_size == 8 and cfg.num_global_microbatches == 4 and cfg.num_microbatches == 2


def test_bubble_counts_compute_only():
    acts = [Action("F", 0, 0, 0, 30), Action("RECV_B", 0, 0, 30, 60, peer=1, wait_ns=30), Action("B", 0, 0, 60, 100)]
    assert bubble_fraction(acts, 0, 200) == pytest.approx(1 - 70 / 200)


_HF = {"hidden_size": 64, "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
       "intermediate_size": 128, "vocab_size": 100}


@pytest.mark.parametrize("extra, bias", [
    ({}, False), ({"attention_bias": True}, True), ({"model_type": "qwen2"}, True),
    ({"model_type": "qwen2", "attention_bias": False}, True)])  # Qwen2's q/k/v always carry a bias
def test_one_bias_rule_for_hf_configs(extra, bias):
    shape = shape_from_hf({**_HF, **extra})
    assert shape.attention_bias is bias and shape.head_dim == 16 and shape.kv_dim == 32


def test_shape_parsing_names_what_is_wrong():
    with pytest.raises(ValueError, match="lacks required key 'vocab_size'"):
        shape_from_hf({k: v for k, v in _HF.items() if k != "vocab_size"})
    with pytest.raises(ValueError, match="model.model_type='mistral'"):
        shape_from_hf({**_HF, "model_type": "mistral"})
    with pytest.raises(ValueError, match="multiple of model.num_key_value_heads=3"):
        ModelShape(**{**_HF, "num_key_value_heads": 3, "head_dim": 16})


def test_layer_split_gives_the_remainder_to_earlier_stages():
    assert layers_per_stage(80, 8) == (10,) * 8
    assert layers_per_stage(81, 8) == (11, 10, 10, 10, 10, 10, 10, 10)
    assert layers_per_stage(10, 3) == (4, 3, 3)
    with pytest.raises(ValueError, match="cannot split 4 layers into 5"):
        layers_per_stage(4, 5)
