"""Config loading: overrides apply, and bad input is one line naming the key."""

from __future__ import annotations

import pytest

from flows.config import load_config
from stages.config import ConfigError

# The tiny config at the size these checks were worked out for: 16 prompts x G 8 = 128 samples.
SMALL = ["task.prompts_per_step=16", "train.micro_batch_size=32"]


def test_tiny_config_loads_with_overrides():
    cfg = load_config("configs/tiny.yaml", [*SMALL, "iterations=2", "train.schedule=gpipe"])
    assert cfg.iterations == 2 and cfg.train.schedule == "gpipe"
    assert cfg.train.pipeline_model_parallel_size == 2


@pytest.mark.parametrize("override, key", [
    ("train.no_such_key=1", "train.no_such_key"),
    ("train.micro_batch_size=abc", "train.micro_batch_size"),
    ("train.pipeline_model_parallel_size=9", "train.pipeline_model_parallel_size"),
    ("train.schedule=zigzag", "train.schedule"),
    ("train.max_tokens_per_microbatch=12", "train.max_tokens_per_microbatch"),
    ("train.pack_row_tokens=12", "train.pack_row_tokens"),  # below S = 13 (packing auto: on with it)
    ("train.logprob_chunk_tokens=0", "train.logprob_chunk_tokens"),
    ("rollout.group_size=1", "rollout.group_size"),
    ("advantage.estimator=ppo", "advantage.estimator"),
    ("run_name=a/b", "run_name"),
    ("run_name=..", "run_name"),
    ("run_name=.", "run_name"),
    ("run_name=.hidden", "run_name"),
    ("run_name=_cache", "run_name"),
    ("cluster.weight_sync=nfs", "cluster.weight_sync"),
    ("cluster.weight_sync_timeout_s=0", "cluster.weight_sync_timeout_s"),
    ("cluster.weight_sync_content_hash=md5", "cluster.weight_sync_content_hash"),
    ("cluster.listen=127.0.0.1:8786", "cluster.listen"),
    ("cluster.listen=::1", "cluster.listen"),
    ("train.lr=inf", "train.lr"),
    ("train.lr=0", "train.lr"),
    ("train.lr_schedule=step", "train.lr_schedule"),
    ("train.lr_warmup_steps=-1", "train.lr_warmup_steps"),
    ("train.kl_beta=-0.1", "train.kl_beta"),
    ("train.max_grad_norm=nan", "train.max_grad_norm"),
    ("train.timeout_s=inf", "train.timeout_s"),
    ("warmup.steps=-3", "warmup.steps"),
    ("reward.timeout_s=inf", "reward.timeout_s"),
    ("cluster.iteration_timeout_s=inf", "cluster.iteration_timeout_s"),
    ("cluster.listen=tcp://0.0.0.0", "cluster.listen"),
    ("rollout.engine=trtllm", "rollout.engine"),
    ("rollout.vllm_timeout_s=0", "rollout.vllm_timeout_s"),
    ("rollout.vllm_kv_cache_bytes=-1", "rollout.vllm_kv_cache_bytes"),
    ("rollout.stop=['']", "rollout.stop"),
])
def test_bad_values_name_the_key_in_one_line(override, key):
    with pytest.raises(ConfigError) as info:
        load_config("configs/tiny.yaml", [*SMALL, override])
    message = str(info.value)
    assert key in message and "\n" not in message


def test_vllm_refuses_a_speculative_draft_in_one_line():
    with pytest.raises(ConfigError, match=r"rollout.draft_layers / draft_path need rollout.engine=native"):
        load_config("configs/tiny.yaml", [*SMALL, "rollout.engine=vllm", "rollout.draft_layers=1"])


def test_microbatch_count_is_the_worst_case_of_the_token_budget():
    # 16 prompts x G 8, S = 7 + 6 = 13: 32 padded samples (416 slots) hold 4 groups -> 4 microbatches.
    assert load_config("configs/tiny.yaml", SMALL).num_microbatches == 4
    # 48 samples hold 6 groups: ceil(16 / 6) = 3 microbatches, the last one partly empty.
    assert load_config("configs/tiny.yaml", [*SMALL, "train.micro_batch_size=48"]).num_microbatches == 3
    packed = load_config("configs/tiny.yaml", [*SMALL, "train.packing=true", "train.max_tokens_per_microbatch=208",
                                               "train.pack_row_tokens=52"])
    assert (packed.num_microbatches, packed.microbatch_layout.rows) == (8, 4)


def test_colocated_engines_are_at_most_the_training_workers():
    """Under colocated placement the engines live in the training workers: asking for more than
    there are would run fewer engines than the config says, so it is refused in one line."""
    with pytest.raises(ConfigError) as info:
        load_config("configs/tiny.yaml", [*SMALL, "cluster.placement=colocated", "rollout.num_engines=3"])
    assert "rollout.num_engines=3" in str(info.value) and "2 training workers" in str(info.value)
    assert "\n" not in str(info.value)
    assert load_config("configs/tiny.yaml", [*SMALL, "cluster.placement=colocated", "rollout.num_engines=2"])
    # Decoupled engines are workers of their own, and a cluster of one's own may offer the rollout
    # resource on other workers too: any count.
    assert load_config("configs/tiny.yaml", [*SMALL, "cluster.placement=decoupled", "rollout.num_engines=3"])
    assert load_config("configs/tiny.yaml", [*SMALL, "cluster.placement=colocated", "rollout.num_engines=3",
                                             "cluster.scheduler_address=tcp://127.0.0.1:8786"])


def test_1f1b_needs_as_many_microbatches_as_stages():
    with pytest.raises(ConfigError, match="micro_batch_size"):
        load_config("configs/tiny.yaml", [*SMALL, "train.micro_batch_size=128"])


def test_missing_file_and_bad_override_form():
    with pytest.raises(ConfigError, match="does not exist"):
        load_config("configs/nope.yaml")
    with pytest.raises(ConfigError, match="key=value"):
        load_config("configs/tiny.yaml", [*SMALL, "iterations"])


def test_a_pretrained_model_at_the_toy_learning_rate_is_warned_about(caplog):
    import logging

    from flows.config import load_config
    from flows.preflight import warn_pretrained_lr

    from types import SimpleNamespace

    def pretrained(lr: float):  # what the check reads of a config with model.path set
        return SimpleNamespace(model=SimpleNamespace(path="models/smollm2-135m-instruct"), lr=lr)

    with caplog.at_level(logging.WARNING, logger="flows.preflight"):
        assert not warn_pretrained_lr(load_config("configs/tiny.yaml", []))  # the toy at its own rate
        assert not warn_pretrained_lr(pretrained(2e-5))  # configs/smollm2-arithmetic.yaml's
        assert caplog.records == []
        assert warn_pretrained_lr(pretrained(1e-3))
    assert "train.lr=0.001" in caplog.records[0].getMessage() and "model.path" in caplog.records[0].getMessage()


def test_bfloat16_on_a_cpu_without_it_is_warned_about_with_the_measured_rates():
    from flows.config import load_config
    from flows.loop import bfloat16_on_cpu, slow_bfloat16_message

    tiny = load_config("configs/tiny.yaml", [])
    assert bfloat16_on_cpu(tiny) == []  # float32 everywhere
    both = load_config("configs/tiny.yaml", ["train.dtype=bfloat16", "rollout.dtype=bfloat16", "rollout.device=cpu"])
    assert bfloat16_on_cpu(both) == ["train.dtype", "rollout.dtype"]
    # the rates measured on a 2-core AMD EPYC VM without AVX-512 BF16 (runs_dir/_cache/host_rates.json)
    message = slow_bfloat16_message(["train.dtype"], 1.22e9, 171.2e9)
    assert message.startswith("train.dtype=bfloat16 on this CPU: its bfloat16 matmul measured 1.22 GFLOP/s against "
                              "float32's 171 (140x slower") and message.endswith("float32 is faster here")
    assert slow_bfloat16_message(["rollout.dtype"], 300e9, 171.2e9) is None  # a CPU with native bfloat16
    assert slow_bfloat16_message([], 1e9, 171e9) is None
