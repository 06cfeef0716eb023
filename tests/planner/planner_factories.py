"""Small keyword factories for planner inputs."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

from planner.config import PlanConfig
from planner.loader import plan_config_from_dict
from planner.model import ModelShape

REPO = Path(__file__).resolve().parents[2]
SEED_CONFIG = REPO / "configs" / "seed-70b.yaml"

# a 16-GPU, 8B plan that evaluates (and searches) in well under a second, in the run's own schema
_SMALL: dict[str, Any] = {
    "run_name": "small-8b",
    "task": {"prompts_per_step": 16},
    "model": {"model_type": "llama", "vocab_size": 128256, "hidden_size": 4096, "intermediate_size": 14336,
              "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8},
    "rollout": {"group_size": 4, "max_new_tokens": 512},
    "train": {"tensor_model_parallel_size": 2, "pipeline_model_parallel_size": 4, "data_parallel_size": 2,
              "schedule": "1f1b", "micro_batch_size": 1},
    "plan": {"cluster": {"num_gpus": 16, "gpus_per_node": 8, "gpu_memory_gib": 80},
             "train": {"recompute": "none", "distributed_optimizer": True},
             "workload": {"prompt_len": 256},
             "rollout": {"placement": "colocated", "rollout_tensor_parallel_size": 2},
             "search": {"enabled": False}},
}
_RUN_TRAIN = ("tensor_model_parallel_size", "pipeline_model_parallel_size", "data_parallel_size",
              "virtual_pipeline_model_parallel_size", "micro_batch_size", "schedule", "clip_eps_low", "clip_eps_high",
              "reference_parallel", "layer_split")
_RUN_WORKLOAD = {"prompts_per_step": ("task", "prompts_per_step"), "group_size": ("rollout", "group_size"),
                 "gen_len": ("rollout", "max_new_tokens")}


def make_model(**overrides: Any) -> ModelShape:
    """A small Llama-shaped model; override any field."""
    fields: dict[str, Any] = dict(name="tiny", hidden_size=256, num_hidden_layers=4, num_attention_heads=8,
                                  num_key_value_heads=2, intermediate_size=704, vocab_size=1000, head_dim=32)
    fields.update(overrides)
    return ModelShape(**fields)


def make_gpt_shape(hidden: int = 1024, heads: int = 16, layers: int = 1) -> ModelShape:
    """GPT-3-style block (MHA, 4h non-gated MLP), the shape of Korthikanti et al.'s formula."""
    return ModelShape(name="gpt", hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
                      num_key_value_heads=heads, intermediate_size=4 * hidden, vocab_size=50257,
                      head_dim=hidden // heads, gated_mlp=False)


def config_dict(**sections: dict[str, Any]) -> dict[str, Any]:
    """The small plan as a run config dict; ``section={key: value}`` updates use the planner's section
    names (cluster, train, workload, rollout, search) and land where a run config keeps them."""
    data = copy.deepcopy(_SMALL)
    for name, values in sections.items():
        for key, value in values.items():
            if name == "train" and key in _RUN_TRAIN:
                data["train"][key] = value
            elif name == "workload" and key in _RUN_WORKLOAD:
                section, run_key = _RUN_WORKLOAD[key]
                data[section][run_key] = value
            elif name == "train" and key in ("activation_impl", "tp_rules"):
                data["plan"][key] = value
            else:
                data["plan"].setdefault(name, {})[key] = value
    return data


def make_plan_config(**sections: dict[str, Any]) -> PlanConfig:
    """A validated small :class:`PlanConfig`; e.g. ``make_plan_config(train={"schedule": "zbv", ...})``."""
    return plan_config_from_dict(config_dict(**sections))
