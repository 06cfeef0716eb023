"""The CLI writes plan.json, report.md and plots; the seed report answers every scenario question."""

import json

import pytest

from planner.cli import main, plan_command
from planner.loader import load_plan_config
from planner.model import estimate_parameter_count
from planner.plan import build_plan
from planner.plots import PLOT_FILES
from planner.report import render_report
from planner_factories import SEED_CONFIG

# Llama-3-8B (HF config.json sizes) on 16 GPUs, 8 prompts of 1024 + 512 tokens, no search
SMALL_OVERRIDES = ["model.hidden_size=4096", "model.intermediate_size=14336", "model.num_hidden_layers=32",
                   "model.num_attention_heads=32", "model.num_key_value_heads=8", "plan.cluster.num_gpus=16",
                   "train.pipeline_model_parallel_size=4", "train.data_parallel_size=1", "task.prompts_per_step=8",
                   "rollout.max_new_tokens=512", "plan.search.enabled=false"]


def test_plan_command_writes_json_report_and_plots(tmp_path, capsys):
    assert plan_command(str(SEED_CONFIG), SMALL_OVERRIDES, str(tmp_path)) == 0
    out = capsys.readouterr().out
    assert "TP4 PP4 DP1" in out and "fits:" in out
    data = json.loads((tmp_path / "plan.json").read_text())
    assert data["parameter_count"] == 8_030_261_248
    assert data["configured"]["label"].startswith("TP4 PP4 DP1 1f1b")
    assert len(data["configured"]["memory_per_rank"]) == 4
    for name in PLOT_FILES.values():
        assert (tmp_path / name).stat().st_size > 10_000
    report = (tmp_path / "report.md").read_text()
    assert "8,030,261,248 parameters" in report


def test_bad_config_returns_2_with_one_line(capsys):
    assert plan_command(str(SEED_CONFIG), ["train.data_parallel_size=4"], None) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("grpoflow plan: train: TP*PP*DP") and "\n" not in err


def test_the_runtime_tiny_config_writes_a_report(tmp_path, capsys):
    assert plan_command(str(SEED_CONFIG.parent / "tiny.yaml"), ["plan.search.enabled=false"], str(tmp_path)) == 0
    assert "plan: TP1 PP2 DP1 1f1b v1 mbs64 none" in capsys.readouterr().out
    assert "parameters" in (tmp_path / "report.md").read_text()


def test_module_entry_point_parses_arguments(capsys):
    assert main([str(SEED_CONFIG), *SMALL_OVERRIDES]) == 0
    assert "plan: TP4 PP4 DP1" in capsys.readouterr().out


@pytest.fixture(scope="module")
def seed_report():
    plan = build_plan(load_plan_config(SEED_CONFIG))
    return plan, render_report(plan, "grpoflow plan configs/seed-70b.yaml --out docs/design-70b")


def test_seed_report_has_every_question_and_follow_up(seed_report):
    _, report = seed_report
    for heading in ("## 1. Pipeline architecture and scheduling", "### 1.3 How 1F1B interacts with a group-level loss",
                    "## 2. Group advantage synchronisation", "## 3. Memory and the activation stash",
                    "### 3.2 Rollout phase: the KV cache", "## 4. Policy staleness and importance sampling",
                    "## Follow-up A", "## Follow-up B", "## Follow-up C", "## Layout search"):
        assert heading in report
    for name in PLOT_FILES.values():
        assert f"]({name})" in report


def test_seed_report_numbers_come_from_the_plan(seed_report):
    plan, report = seed_report
    assert f"{estimate_parameter_count(plan.config.model_shape):,} parameters" in report
    assert "**708.7 GB** with the shared prefix" in report  # 327,680 B x 2,162,688 tokens
    assert f"{plan.layout.memory[0].total_bytes / 2**30:.1f} GiB" in report
    assert plan.layout.rejection is None
    assert plan.search is not None and plan.search.feasible
