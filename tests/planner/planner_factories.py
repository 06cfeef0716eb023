"""Small keyword factories for planner inputs."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

from planner.config import PlanConfig, plan_config_from_dict
from planner.model import ModelShape

REPO = Path(__file__).resolve().parents[2]
SEED_CONFIG = REPO / "configs" / "seed-70b.yaml"

# a 16-GPU, 8B plan that evaluates (and searches) in well under a second
_SMALL: dict[str, dict[str, Any]] = {
    "model": {"preset": "llama3-8b"},
    "cluster": {"num_gpus": 16, "gpus_per_node": 8, "gpu_memory_gib": 80},
    "train": {"tensor_model_parallel_size": 2, "pipeline_model_parallel_size": 4, "data_parallel_size": 2,
              "schedule": "1f1b", "recompute": "none"},
    "workload": {"prompts_per_step": 16, "group_size": 4, "prompt_len": 256, "gen_len": 512},
    "rollout": {"placement": "colocated", "rollout_tensor_parallel_size": 2},
    "search": {"enabled": False},
}


def make_model(**overrides: Any) -> ModelShape:
    """A small Llama-shaped model; override any field."""
    fields: dict[str, Any] = dict(name="tiny", hidden_size=256, num_layers=4, num_attention_heads=8,
                                  num_key_value_heads=2, intermediate_size=704, vocab_size=1000, head_dim=32)
    fields.update(overrides)
    return ModelShape(**fields)


def make_gpt_shape(hidden: int = 1024, heads: int = 16, layers: int = 1) -> ModelShape:
    """GPT-3-style block (MHA, 4h non-gated MLP), the shape of Korthikanti et al.'s formula."""
    return ModelShape(name="gpt", hidden_size=hidden, num_layers=layers, num_attention_heads=heads,
                      num_key_value_heads=heads, intermediate_size=4 * hidden, vocab_size=50257,
                      head_dim=hidden // heads, gated_mlp=False)


def config_dict(**sections: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """The small plan as a nested dict, with ``section={key: value}`` updates merged in."""
    data = copy.deepcopy(_SMALL)
    for name, values in sections.items():
        data.setdefault(name, {}).update(values)
    return data


def make_plan_config(**sections: dict[str, Any]) -> PlanConfig:
    """A validated small :class:`PlanConfig`; e.g. ``make_plan_config(train={"schedule": "zbv", ...})``."""
    return plan_config_from_dict(config_dict(**sections))
