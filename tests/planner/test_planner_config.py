"""Config loading: YAML + dotlist overrides into frozen dataclasses; one-line errors naming key and fix."""

import json

import pytest

from planner.config import PlanConfigError, load_plan_config, plan_config_from_dict
from planner_factories import SEED_CONFIG, config_dict, make_plan_config


def test_seed_config_loads_the_scenario():
    cfg = load_plan_config(SEED_CONFIG)
    t = cfg.train
    assert (t.tensor_model_parallel_size, t.pipeline_model_parallel_size, t.data_parallel_size) == (4, 8, 2)
    assert cfg.model_shape.num_layers == 80 and cfg.workload.group_size == 8
    assert (cfg.workload.prompt_len, cfg.workload.gen_len) == (1024, 4096)
    assert cfg.cluster.num_gpus == 64 and cfg.cluster.memory_bytes == 80 * 1024**3
    assert cfg.num_microbatches == 64 * 8 // 2  # 512 samples over DP 2 at micro-batch 1


def test_dotlist_overrides_are_typed():
    cfg = load_plan_config(SEED_CONFIG, ["train.pipeline_model_parallel_size=4", "train.data_parallel_size=4",
                                         "rollout.staleness=1", "cluster.mfu=0.5"])
    assert cfg.train.pipeline_model_parallel_size == 4 and cfg.rollout.staleness == 1 and cfg.cluster.mfu == 0.5


def test_configs_are_frozen():
    cfg = make_plan_config()
    with pytest.raises(AttributeError):
        cfg.train.micro_batch_size = 2  # type: ignore[misc]


@pytest.mark.parametrize(("overrides", "fragment"), [
    (["train.pipline_model_parallel_size=4"], "train.pipline_model_parallel_size: unknown key"),
    (["train.micro_batch_size=two"], "train.micro_batch_size: expected an integer"),
    (["train.distributed_optimizer=3"], "train.distributed_optimizer: expected true or false"),
    (["train.schedule=pipedream"], "train.schedule: 'pipedream' is not one of"),
    (["train.data_parallel_size=4"], "TP*PP*DP = 4*8*4 = 128 must equal the training GPUs (64); set train.data_parallel_size=2"),
    (["train.pipeline_model_parallel_size=128", "train.data_parallel_size=1", "train.tensor_model_parallel_size=1",
      "cluster.num_gpus=128"], "PP*v = 128*1 = 128 stages exceed the 80 layers"),
    (["train.tensor_model_parallel_size=3", "train.data_parallel_size=1", "train.pipeline_model_parallel_size=1",
      "cluster.num_gpus=3", "rollout.rollout_tensor_parallel_size=1"], "must divide num_attention_heads (64)"),
    (["rollout.placement=decoupled"], "rollout.rollout_gpus: decoupled placement needs"),
    (["rollout.rollout_gpus=16"], "applies to placement=decoupled only"),
    (["train.schedule=zbv"], "set virtual_pipeline_model_parallel_size=2"),
    (["workload.group_size=1"], "GRPO needs G >= 2"),
    (["cluster.mfu=1.5"], "cluster.mfu: must be in (0, 1]"),
    (["train.micro_batch_size=3"], "choose micro_batch_size dividing 256"),
    (["train.schedule"], "write overrides as section.key=value"),
])
def test_bad_input_is_one_line_naming_the_key(overrides, fragment):
    with pytest.raises(PlanConfigError) as info:
        load_plan_config(SEED_CONFIG, overrides)
    message = str(info.value)
    assert fragment in message
    assert "\n" not in message


def test_decoupled_split_needs_the_rest_to_train():
    cfg = make_plan_config(rollout={"placement": "decoupled", "rollout_gpus": 8},
                           train={"data_parallel_size": 1})
    assert cfg.training_gpus == 8 and cfg.rollout_gpus == 8
    with pytest.raises(PlanConfigError, match="must equal the training GPUs"):
        make_plan_config(rollout={"placement": "decoupled", "rollout_gpus": 8})


def test_model_needs_exactly_one_source():
    with pytest.raises(PlanConfigError, match="exactly one of model.hf_config"):
        plan_config_from_dict(config_dict(model={"hf_config": "x.json"}))
    with pytest.raises(PlanConfigError, match="exactly one"):
        plan_config_from_dict({"model": {}})


def test_hf_config_path_resolves_against_the_config_folder(tmp_path):
    (tmp_path / "tiny").mkdir()
    (tmp_path / "tiny" / "config.json").write_text(json.dumps({
        "hidden_size": 64, "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
        "intermediate_size": 128, "vocab_size": 100}))
    path = tmp_path / "plan.yaml"
    path.write_text("model:\n  hf_config: tiny\ncluster:\n  num_gpus: 2\ntrain:\n  tensor_model_parallel_size: 1\n"
                    "  pipeline_model_parallel_size: 2\n  data_parallel_size: 1\nworkload:\n  prompts_per_step: 4\n"
                    "  group_size: 2\nrollout:\n  rollout_tensor_parallel_size: 1\nstorage:\n  root: runs/\n")
    cfg = load_plan_config(path)  # the runtime-only 'storage' section is ignored
    assert cfg.model_shape.name == "tiny" and cfg.model_shape.head_dim == 16
    with pytest.raises(PlanConfigError, match="no file at"):
        load_plan_config(tmp_path / "missing.yaml")
