"""Config loading: YAML + dotlist overrides into frozen dataclasses; one-line errors naming key and fix."""

import json
import os

import pytest

from planner.config import PlanConfigError
from planner.loader import load_plan_config
from planner_factories import REPO, SEED_CONFIG, make_plan_config


def test_seed_config_loads_the_scenario():
    cfg = load_plan_config(SEED_CONFIG)
    t = cfg.train
    assert (t.tensor_model_parallel_size, t.pipeline_model_parallel_size, t.data_parallel_size) == (4, 8, 2)
    assert cfg.model_shape.num_hidden_layers == 80 and cfg.workload.group_size == 8
    assert (cfg.workload.prompt_len, cfg.workload.gen_len) == (1024, 4096)
    assert cfg.cluster.num_gpus == 64 and cfg.cluster.memory_bytes == 80 * 1024**3
    assert cfg.num_microbatches == 64 * 8 // 2  # 512 samples over DP 2 at micro-batch 1


def test_dotlist_overrides_are_typed():
    cfg = load_plan_config(SEED_CONFIG, ["train.pipeline_model_parallel_size=4", "train.data_parallel_size=4",
                                         "plan.rollout.staleness=1", "plan.cluster.mfu=0.5"])
    assert cfg.train.pipeline_model_parallel_size == 4 and cfg.rollout.staleness == 1 and cfg.cluster.mfu == 0.5


def test_configs_are_frozen():
    cfg = make_plan_config()
    with pytest.raises(AttributeError):
        cfg.train.micro_batch_size = 2  # type: ignore[misc]


@pytest.mark.parametrize(("overrides", "fragment"), [
    (["train.pipline_model_parallel_size=4"], "train.pipline_model_parallel_size"),
    (["train.micro_batch_size=two"], "train.micro_batch_size"),
    (["plan.train.distributed_optimizer=3"], "plan.train.distributed_optimizer: expected true or false"),
    (["plan.train.schedule=zbv"], "plan.train.schedule: the run's own setting; set train.schedule instead"),
    (["plan.clusters.num_gpus=8"], "plan.clusters: unknown key"),
    (["train.schedule=pipedream"], "train.schedule='pipedream' is not one of"),
    (["train.data_parallel_size=4"], "TP*PP*DP = 4*8*4 = 128 must equal the training GPUs (64 of plan.cluster.num_gpus); "
                                     "set train.data_parallel_size=2"),
    (["train.pipeline_model_parallel_size=128", "train.data_parallel_size=1", "train.tensor_model_parallel_size=1",
      "plan.cluster.num_gpus=128"], "cannot be split into train.pipeline_model_parallel_size"),
    (["train.tensor_model_parallel_size=3", "train.data_parallel_size=1", "train.pipeline_model_parallel_size=1",
      "plan.cluster.num_gpus=3", "plan.rollout.rollout_tensor_parallel_size=1"],
     "train.tensor_model_parallel_size=3 must divide model.num_attention_heads=64"),
    (["plan.rollout.placement=decoupled"], "plan.rollout.rollout_gpus: decoupled placement needs"),
    (["plan.rollout.rollout_gpus=16"], "applies to placement=decoupled only"),
    (["train.schedule=zbv"], "set train.virtual_pipeline_model_parallel_size=2"),
    (["rollout.group_size=1"], "rollout.group_size must be >= 2"),
    (["plan.cluster.mfu=1.5"], "plan.cluster.mfu: must be in (0, 1]"),
    (["train.data_parallel_size=3", "plan.cluster.num_gpus=96"], "must divide task.prompts_per_step=64"),
    (["plan.activation_impl=apex"], "'apex' is not one of torch-eager, megatron-te"),
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


def test_model_path_reads_config_json_relative_to_the_config_folder(tmp_path):
    (tmp_path / "tiny").mkdir()
    (tmp_path / "tiny" / "config.json").write_text(json.dumps({
        "model_type": "qwen2", "hidden_size": 64, "num_hidden_layers": 4, "num_attention_heads": 4,
        "num_key_value_heads": 2, "intermediate_size": 128, "vocab_size": 100}))
    path = tmp_path / "run.yaml"
    path.write_text("model:\n  path: tiny\ntask:\n  prompts_per_step: 4\nrollout:\n  group_size: 2\n"
                    "train:\n  pipeline_model_parallel_size: 2\n  micro_batch_size: 1\n")
    cfg = load_plan_config(path)
    assert cfg.model_shape.name == "tiny" and cfg.model_shape.head_dim == 16 and cfg.model_shape.attention_bias
    assert cfg.cluster.num_gpus == 2  # unset: the run's own pp x dp x tp ranks
    with pytest.raises(PlanConfigError, match="no file at"):
        load_plan_config(tmp_path / "missing.yaml")


def test_the_runtime_tiny_config_plans_as_is():
    cfg = load_plan_config(REPO / "configs" / "tiny.yaml")
    shape = cfg.model_shape
    assert (shape.hidden_size, shape.num_hidden_layers, shape.vocab_size) == (64, 4, 15)  # 3 specials + 12 chars
    assert (cfg.workload.prompts_per_step, cfg.workload.group_size) == (64, 8)
    assert (cfg.workload.prompt_len, cfg.workload.gen_len) == (7, 6)  # "<bos>ab+cd=" and max_new_tokens
    assert cfg.num_microbatches == 8  # tiny.yaml: 512 samples, 8 whole groups per microbatch
    assert cfg.train.activation_impl == "torch-eager" and cfg.train.tp_rules == "runtime"


def test_a_cpu_run_is_planned_on_this_host_at_its_measured_rates(tmp_path):
    """train.device cpu and no plan.cluster: the ranks share this host's cores, RAM and measured matmul
    rate (taken from the runs_dir's host-rate cache); plan.cluster given: the GPUs it names."""
    from planner.host import CPU_STEP_MFU
    from storage.host_rates import HOST_RATES_FILE, host_cores, host_rate_key, save_host_rates

    save_host_rates(tmp_path / "_cache" / HOST_RATES_FILE, {host_rate_key("float32", "cpu", host_cores()): 3.0e11})
    cpu = load_plan_config(REPO / "configs" / "tiny.yaml", [f"runs_dir={tmp_path}"]).cluster
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    assert cpu.device == "cpu" and cpu.num_gpus == cpu.gpus_per_node == 2
    assert cpu.peak_flops == 1.5e11 and cpu.mfu == CPU_STEP_MFU  # 3e11 over 2 ranks
    assert cpu.memory_bytes == ram // 2
    gpu = load_plan_config(REPO / "configs" / "tiny.yaml", [f"runs_dir={tmp_path}", "plan.cluster.num_gpus=2"]).cluster
    assert gpu.device == "gpu" and gpu.peak_flops == 989e12
    assert load_plan_config(SEED_CONFIG).cluster.device == "gpu"  # its plan.cluster section


def test_the_cpu_plan_says_so_in_its_summary(tmp_path, capsys):
    from planner.cli import plan_command

    assert plan_command(str(REPO / "configs" / "tiny.yaml"), [f"runs_dir={tmp_path}"], None) == 0
    out = capsys.readouterr().out
    assert "2 CPU ranks on this host" in out and "device: this host's CPU" in out and "GPUs" not in out.splitlines()[0]
