"""The train section's auto values resolved by the run config (GRPOConfig.length_buckets,
.packing, .logprob_chunk_tokens), explicit values winning over auto, and the shipped configs."""

from __future__ import annotations

from pathlib import Path

import pytest

from flows.config import load_config
from stages.train.buckets import BucketedLayout
from stages.train.plan import MicrobatchLayout

# benchmarks/iteration.py's bench scenario without its layout flags: S = 7 + 64 = 71, B = 8 x 71.
BENCH = ["model.hidden_size=512", "model.intermediate_size=1376", "model.num_hidden_layers=8",
         "model.num_attention_heads=8", "model.num_key_value_heads=4", "task.prompts_per_step=16",
         "rollout.max_new_tokens=64", "warmup.steps=0", "train.micro_batch_size=8"]
OLD_DEFAULTS = ["train.length_buckets=null", "train.packing=false", "train.logprob_chunk_tokens=null"]


def test_tiny_resolves_to_the_old_defaults():
    cfg = load_config("configs/tiny.yaml")
    assert (cfg.train.length_buckets, cfg.train.packing, cfg.train.logprob_chunk_tokens) == ("auto",) * 3
    assert (cfg.length_buckets, cfg.packing, cfg.logprob_chunk_tokens) == (None, False, None)
    old = load_config("configs/tiny.yaml", OLD_DEFAULTS)
    assert isinstance(cfg.microbatch_layout, MicrobatchLayout) and cfg.microbatch_layout == old.microbatch_layout
    assert cfg.num_microbatches == old.num_microbatches == 8


def test_bench_resolves_to_the_tuned_flags_and_a_2s_row():
    cfg = load_config("configs/tiny.yaml", BENCH)
    # the tuned [16, 32, 71] and packed rows of 2S = 142 (attention share 2.5%, budget 568 slots)
    assert (cfg.length_buckets, cfg.packing, cfg.logprob_chunk_tokens) == ((16, 32, 71, 142), True, None)
    tuned = load_config("configs/tiny.yaml", [*BENCH, "train.length_buckets=[16,32,71,142]", "train.packing=true"])
    assert isinstance(cfg.microbatch_layout, BucketedLayout) and cfg.microbatch_layout == tuned.microbatch_layout
    # B = 568 slots: 568 // 16, 568 // 32, 568 // 71, 568 // 142; the 142-wide rows hold sequences of up to 71
    assert [(b.rows, b.seq_len, b.max_seq_len, b.packing) for b in cfg.microbatch_layout.buckets] == [
        (35, 16, 16, True), (17, 32, 32, True), (8, 71, 71, True), (4, 142, 71, True)]
    padded = load_config("configs/tiny.yaml", [*BENCH, "train.packing=false"])
    assert padded.length_buckets == (16, 32, 71)  # a padded row holds one sequence: no 2S bucket


@pytest.mark.parametrize("overrides, expected", [
    (["train.length_buckets=null"], (None, False)),  # one pass for the worst case, padded
    (["train.packing=false"], ((16, 32, 71), False)),  # padded buckets, no 2S row
    (["train.length_buckets=null", "train.packing=true"], (None, True)),  # the packed worst-case layout
    (["train.length_buckets=[10,40]"], ((10, 40), True)),  # explicit widths, packed by auto
    (["train.pack_row_tokens=142"], (None, True)),  # packed rows of 142 instead of buckets
])
def test_explicit_layout_values_win_over_auto(overrides, expected):
    cfg = load_config("configs/tiny.yaml", [*BENCH, *overrides])
    assert (cfg.length_buckets, cfg.packing) == expected
    assert cfg.microbatch_layout.packing is expected[1]


def test_chunk_size_follows_the_vocabulary_unless_set():
    # The built-in model's vocabulary is the addition tokenizer's (15) unless model.vocab_size is set.
    assert load_config("configs/tiny.yaml").model_shape.vocab_size == 15
    assert load_config("configs/tiny.yaml", ["model.vocab_size=49152"]).logprob_chunk_tokens == 256
    assert load_config("configs/tiny.yaml", ["model.vocab_size=49152",
                                             "train.logprob_chunk_tokens=null"]).logprob_chunk_tokens is None
    assert load_config("configs/tiny.yaml", ["train.logprob_chunk_tokens=64"]).logprob_chunk_tokens == 64


def test_seed_70b_config_loads_with_auto_buckets():
    cfg = load_config("configs/seed-70b.yaml")  # S = 7 + 4096 (the built-in addition prompt)
    assert cfg.length_buckets == (16, 32, 64, 128, 256, 512, 1024, 2048, 4103) and cfg.packing
    assert cfg.logprob_chunk_tokens == 256  # Llama-3's 128,256 tokens


@pytest.mark.skipif(not Path("models/smollm2-135m-instruct/config.json").is_file(),
                    reason="models/smollm2-135m-instruct absent (make model)")
def test_smollm2_config_loads_with_its_chunk_size_and_auto_buckets():
    cfg = load_config("configs/smollm2-arithmetic.yaml")  # S = 96 + 48, vocabulary 49,152
    # micro_batch_size 2: a budget of 288 slots holds one packed row of 2S = 288
    assert (cfg.length_buckets, cfg.packing, cfg.logprob_chunk_tokens) == ((16, 32, 64, 144, 288), True, 256)
    assert [(b.rows, b.seq_len, b.max_seq_len) for b in cfg.microbatch_layout.buckets][-2:] == [(2, 144, 144),
                                                                                              (1, 288, 144)]


def _pretrained_folder(tmp_path: Path) -> Path:
    """An HF folder holding only the config.json the run config reads (SmolLM2-135M's sizes)."""
    import json

    (tmp_path / "config.json").write_text(json.dumps({
        "model_type": "llama", "hidden_size": 576, "intermediate_size": 1536, "num_hidden_layers": 30,
        "num_attention_heads": 9, "num_key_value_heads": 3, "vocab_size": 49152, "max_position_embeddings": 8192,
        "rms_norm_eps": 1e-5, "rope_theta": 100000.0, "tie_word_embeddings": True, "bos_token_id": 1,
        "eos_token_id": 2, "pad_token_id": 2}))
    return tmp_path


def test_lr_auto_is_the_built_in_rate_or_the_pretrained_one(tmp_path):
    from stages.train.auto import BUILTIN_MODEL_LR, PRETRAINED_LR

    assert (BUILTIN_MODEL_LR, PRETRAINED_LR) == (1e-3, 2e-5)
    assert load_config("configs/tiny.yaml").lr == 7e-4  # the config's own number
    assert load_config("configs/tiny.yaml", ["train.lr=auto"]).lr == 1e-3
    pretrained = load_config("configs/tiny.yaml", ["train.lr=auto", f"model.path={_pretrained_folder(tmp_path)}"])
    assert pretrained.train.lr == "auto" and pretrained.lr == 2e-5
    assert load_config("configs/tiny.yaml", ["train.lr=1e-5"]).lr == 1e-5  # a string to YAML, a number here


@pytest.mark.parametrize("value", ["fast", "-1", "0", "inf"])
def test_lr_neither_auto_nor_a_positive_number_is_refused_in_one_line(value):
    from stages.config import ConfigError

    with pytest.raises(ConfigError, match=r"^train\.lr=") as caught:
        load_config("configs/tiny.yaml", [f"train.lr={value}"])
    assert "\n" not in str(caught.value)


def test_a_run_stored_with_the_rate_auto_picks_resumes_under_auto():
    from flows.preflight import _lr_resolved, config_differences
    from flows.config import config_to_dict

    auto = load_config("configs/tiny.yaml", ["train.lr=auto"])
    stored = config_to_dict(load_config("configs/tiny.yaml", ["train.lr=0.001"]))
    assert config_differences(_lr_resolved(stored, auto), _lr_resolved(config_to_dict(auto), auto)) == []
    other = config_to_dict(load_config("configs/tiny.yaml", ["train.lr=0.002"]))
    assert config_differences(_lr_resolved(other, auto), _lr_resolved(config_to_dict(auto), auto)) == ["train.lr"]
