"""Real HF model folders: Llama 3.1 (llama3 RoPE scaling) and Qwen3 (q/k norm) folders written by
transformers load through storage/ into the runtime decoder with transformers' logits, a version
saved back loads in transformers with the same logits, and the Qwen3 decoder trains through the
local pipeline runner."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import pytest
import torch

from conftest import make_decoder_config, make_model, make_rollout_arrays, random_hf_model
from stages.layout.shape import RopeScaling, hf_rope_scaling
from stages.policy import DecoderConfig, build_stage, hf_named_parameters, hf_state, load_hf_state, stage_hf_names
from stages.policy.model import rope_inv_freq
from stages.policy.tokenizer import TextCodec
from stages.tasks.addition import make_tokenizer_json
from storage.policies import PolicyStore, load_model_folder

import transformers  # a test dependency: these parity tests fail, never skip, without it

_PARITY_ATOL = 1e-4  # fp32 logits of two implementations of the same maths
_WEIGHT_STD = 0.2  # every tensor random and far from HF's init (zero biases, unit norms hide bugs)
# head_dim 16, theta 1e4: rotary wavelengths 2 pi 1e4^(i/8) = 6.3, 19.9, 62.8, 199, ... With an original
# context of 64 (factor 8, low 1, high 4) frequency 0 is kept (< 64/4), 1 and 2 lie in the smooth band
# [16, 64] and 3.. are divided by 8; 96 tokens run past the original context.
_LLAMA3_SCALING = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                   "original_max_position_embeddings": 64}
_SEQ_LEN = 96
_SIZES = dict(vocab_size=15, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2,
              pad_token_id=0)
_TOKENIZER_CONFIG = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<bos>", "eos_token": "<eos>",
                     "pad_token": "<pad>"}


def llama31_config(**overrides) -> "transformers.PretrainedConfig":
    return transformers.LlamaConfig(**{**_SIZES, "rope_theta": 10000.0, "rope_scaling": dict(_LLAMA3_SCALING),
                                       "max_position_embeddings": 512, **overrides})


def qwen3_config(**overrides) -> "transformers.PretrainedConfig":
    return transformers.Qwen3Config(**{**_SIZES, "rope_theta": 1000.0, **overrides})


def make_hf_folder(hf_config, path: Path, seed: int = 0):
    """A random-weight transformers model saved as an HF folder with tokenizer files; returns the model."""
    model = random_hf_model(hf_config, seed, _WEIGHT_STD)
    # transformers 5 always writes safetensors (4.x needed safe_serialization=True for it).
    model.save_pretrained(path)
    (path / "tokenizer.json").write_text(make_tokenizer_json())
    (path / "tokenizer_config.json").write_text(json.dumps(_TOKENIZER_CONFIG))
    (path / "special_tokens_map.json").write_text(json.dumps({k: v for k, v in _TOKENIZER_CONFIG.items()
                                                              if k.endswith("_token")}))
    return model.eval()


def runtime_model(path: Path):
    """The runtime decoder of an HF folder, the way flows/ builds it."""
    hf_config, _, tensors = load_model_folder(path)
    model = build_stage(DecoderConfig.from_hf(hf_config))
    model.init_weights(torch.Generator().manual_seed(99))  # anything but the folder's values
    load_hf_state(model, tensors)
    assert set(stage_hf_names(model)) == set(tensors)  # every tensor of the folder has a home
    return model.eval()


def make_ids(vocab_size: int, length: int = _SEQ_LEN, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, vocab_size, (2, length), generator=torch.Generator().manual_seed(seed))


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    assert a.shape == b.shape
    return (a - b).abs().max().item()


FOLDERS = {
    "llama3.1": lambda: llama31_config(),
    "llama3.1-bias-tied": lambda: llama31_config(attention_bias=True, tie_word_embeddings=True),
    "llama3.1-rope_parameters": lambda: llama31_config(rope_scaling=None, rope_parameters={
        **_LLAMA3_SCALING, "rope_theta": 5000.0}),
    "qwen3": lambda: qwen3_config(),
    "qwen3-bias-tied": lambda: qwen3_config(attention_bias=True, tie_word_embeddings=True),
    "qwen3-llama3-rope": lambda: qwen3_config(rope_scaling=dict(_LLAMA3_SCALING)),
}


# -- loading a folder ------------------------------------------------------------------------------
@pytest.mark.parametrize("name", FOLDERS)
def test_folder_logits_match_transformers(name, tmp_path):
    hf_model = make_hf_folder(FOLDERS[name](), tmp_path)
    ours = runtime_model(tmp_path)
    ids = make_ids(ours.cfg.vocab_size)
    with torch.no_grad():
        assert max_diff(ours(ids), hf_model(ids).logits) <= _PARITY_ATOL


def test_the_scaling_and_the_qk_norm_change_the_logits(tmp_path):
    """The parity above could not pass with either feature ignored: each moves the logits far
    beyond the tolerance."""
    make_hf_folder(llama31_config(), tmp_path / "llama")
    make_hf_folder(qwen3_config(), tmp_path / "qwen3")
    for path, cut in ((tmp_path / "llama", dict(rope_scaling=None)), (tmp_path / "qwen3", dict(model_type="llama"))):
        full = runtime_model(path)
        reduced = build_stage(dataclasses.replace(full.cfg, **cut))
        load_hf_state(reduced, {n: t for n, t in hf_state(full).items() if n in stage_hf_names(reduced)})
        ids = make_ids(full.cfg.vocab_size)
        with torch.no_grad():
            assert max_diff(full(ids), reduced.eval()(ids)) > 100 * _PARITY_ATOL, cut


def test_qwen3_folder_has_q_and_k_norm_weights(tmp_path):
    make_hf_folder(qwen3_config(), tmp_path)
    names = stage_hf_names(runtime_model(tmp_path))
    for layer in range(_SIZES["num_hidden_layers"]):
        for norm in ("q_norm", "k_norm"):
            assert f"model.layers.{layer}.self_attn.{norm}.weight" in names


def test_cached_generation_matches_transformers(tmp_path):
    """The rollout engine's KV-cache decode of a Qwen3 folder with llama3 RoPE, prompts and
    completions running past the original context: its behaviour log-probs are transformers'."""
    from stages.rollout import SamplingParams, generate

    hf_model = make_hf_folder(FOLDERS["qwen3-llama3-rope"](), tmp_path)
    ours = runtime_model(tmp_path)
    gen = torch.Generator().manual_seed(5)
    prompts = [torch.randint(1, 15, (n,), generator=gen).tolist() for n in (50, 70)]
    params = SamplingParams(group_size=2, max_new_tokens=30, temperature=0.8, pad_id=0)
    batch = generate(ours, prompts, params, torch.Generator().manual_seed(0))
    for row in range(len(prompts) * params.group_size):
        prompt = prompts[row // params.group_size]
        completion = batch.tokens[row, : batch.length[row]].tolist()
        with torch.no_grad():
            logits = hf_model(torch.tensor([prompt + completion])).logits[0, len(prompt) - 1: -1]
        expected = torch.log_softmax(logits / params.temperature, dim=-1)[torch.arange(len(completion)), completion]
        assert max_diff(torch.from_numpy(batch.behav_logp[row, : len(completion)]), expected) <= _PARITY_ATOL


# -- saving a version back -------------------------------------------------------------------------
def _trained_version(name: str, tmp_path: Path, version: int = 1):
    """(the runtime model, its PolicyRef, the tokenizer.json text, the source folder): a version
    saved from weights that differ from the source's, as after a training step."""
    source = tmp_path / "source"
    make_hf_folder(FOLDERS[name](), source)
    ours = runtime_model(source)
    with torch.no_grad():
        for _, p in hf_named_parameters(ours):
            p.mul_(1.01)
    _, tokenizer_json, _ = load_model_folder(source, names=set())
    ref = PolicyStore(tmp_path / "policy").save_policy(version, ours.cfg.to_hf(), tokenizer_json, hf_state(ours),
                                                       source=source)
    return ours, ref, tokenizer_json, source


@pytest.mark.parametrize("name", ["llama3.1", "qwen3-bias-tied"])
def test_saved_version_loads_in_transformers(name, tmp_path):
    ours, ref, tokenizer_json, source = _trained_version(name, tmp_path)
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(ref.path, attn_implementation="eager").eval()
    assert reloaded.config.model_type == ours.cfg.model_type
    ids = make_ids(ours.cfg.vocab_size, seed=1)
    with torch.no_grad():
        assert max_diff(reloaded(ids).logits, ours(ids)) <= _PARITY_ATOL
    # The version is a whole HF folder: the tokenizer and generation defaults come with it.
    for side in ("tokenizer_config.json", "special_tokens_map.json", "generation_config.json"):
        assert (Path(ref.path) / side).read_text() == (source / side).read_text()
    tokenizer = transformers.AutoTokenizer.from_pretrained(ref.path)
    codec = TextCodec.from_json(tokenizer_json)
    assert tokenizer("12+7=")["input_ids"] == codec.encode("12+7=")
    assert tokenizer.pad_token_id == codec.pad_id and tokenizer.eos_token_id == codec.eos_id


def test_a_trained_version_generates_in_transformers_as_in_the_engine(tmp_path):
    """A policy version taken out of a run (policy/v<k>/, an HF folder) is greedy-decoded by
    transformers' generate to the very tokens the rollout engine picks (top_k = 1, as eval's
    greedy completions)."""
    from stages.rollout import SamplingParams, generate

    ours, ref, _, _ = _trained_version("llama3.1", tmp_path, version=3)
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(ref.path, attn_implementation="eager").eval()
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, ours.cfg.vocab_size, (n,), generator=gen).tolist() for n in (5, 9, 12)]
    params = SamplingParams(group_size=1, max_new_tokens=12, top_k=1, pad_id=0)
    batch = generate(runtime_model(Path(ref.path)), prompts, params, torch.Generator().manual_seed(0))
    for row, prompt in enumerate(prompts):
        with torch.no_grad():
            out = reloaded.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=12, min_new_tokens=12,
                                    eos_token_id=None, pad_token_id=0)
        assert out[0, len(prompt):].tolist() == batch.tokens[row, : batch.length[row]].tolist()


def test_a_version_without_a_source_has_no_side_files(tmp_path):
    cfg = make_decoder_config(model_type="qwen3")
    ref = PolicyStore(tmp_path).save_policy(0, cfg.to_hf(), make_tokenizer_json(), hf_state(make_model(cfg)))
    assert not (Path(ref.path) / "tokenizer_config.json").exists()


# -- config.json parsing ---------------------------------------------------------------------------
def test_hf_config_round_trip_keeps_scaling_and_qwen3():
    scaling = RopeScaling(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                          original_max_position_embeddings=8192)
    for cfg in (make_decoder_config(rope_scaling=scaling, rope_theta=5e5),
                make_decoder_config(model_type="qwen3", attention_bias=True),
                make_decoder_config(model_type="qwen3", rope_scaling=scaling)):
        assert DecoderConfig.from_hf(cfg.to_hf()) == cfg
        # transformers 5 rewrites the file with rope_parameters; it still reads back the same.
        as_v5 = transformers.AutoConfig.for_model(**cfg.to_hf()).to_dict()
        assert "rope_scaling" not in as_v5 or as_v5["rope_scaling"] == as_v5["rope_parameters"]
        assert DecoderConfig.from_hf(as_v5) == cfg


def test_bias_rule():
    base = {**make_decoder_config().to_hf()}
    assert DecoderConfig.from_hf({**base, "model_type": "qwen2", "attention_bias": False}).attention_bias
    assert not DecoderConfig.from_hf({**base, "model_type": "qwen3", "attention_bias": False}).attention_bias
    assert DecoderConfig.from_hf({**base, "model_type": "qwen3", "attention_bias": True}).attention_bias
    assert not DecoderConfig.from_hf({**base, "model_type": "llama", "attention_bias": None}).attention_bias


def test_qwen3_head_dim_defaults_like_transformers():
    hf = {k: v for k, v in make_decoder_config(model_type="qwen3").to_hf().items() if k != "head_dim"}
    assert DecoderConfig.from_hf(hf).head_dim == transformers.Qwen3Config().head_dim == 128
    assert DecoderConfig.from_hf({**hf, "model_type": "llama"}).head_dim == 32 // 4


@pytest.mark.parametrize("rope, match", [
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "'yarn' is not supported; supported: llama3"),
    ({"rope_scaling": {"type": "dynamic", "factor": 2.0}}, "'dynamic' is not supported; supported: llama3"),
    ({"rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4}}, "'linear'"),
    ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "high_freq_factor": 4.0}}, "'low_freq_factor'"),
    ({"rope_scaling": {**_LLAMA3_SCALING, "low_freq_factor": 4.0}}, "rope_scaling.low_freq_factor"),
    ({"partial_rotary_factor": 0.5}, "partial_rotary_factor"),
])
def test_unsupported_rope_is_named(rope, match):
    with pytest.raises(ValueError, match=match):
        DecoderConfig.from_hf({**make_decoder_config().to_hf(), **rope})


def test_sliding_window_is_rejected():
    hf = make_decoder_config(model_type="qwen3").to_hf()
    for extra in ({"use_sliding_window": True}, {"layer_types": ["full_attention", "sliding_attention"]}):
        with pytest.raises(ValueError, match="sliding-window"):
            DecoderConfig.from_hf({**hf, **extra})


# -- the llama3 frequencies by hand ----------------------------------------------------------------
def test_llama3_inv_freq_by_hand():
    # d = 4, theta = 100: f = (1, 0.1), wavelengths 2 pi = 6.28 and 20 pi = 62.83.
    assert rope_inv_freq(4, 100.0).tolist() == pytest.approx([1.0, 0.1])
    # L = 32: f0 kept (6.28 < 32/4 = 8), f1 fully scaled (62.83 > 32/1): 0.1 / 8.
    short = RopeScaling(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=32)
    assert rope_inv_freq(4, 100.0, short).tolist() == pytest.approx([1.0, 0.0125])
    # L = 128: f1 in the band [32, 128]: s = (128 / 62.832 - 1) / 3 = 0.345727,
    # f1 = 0.1 ((1 - s) / 8 + s) = 0.1 (0.081784 + 0.345727) = 0.0427511.
    band = dataclasses.replace(short, original_max_position_embeddings=128)
    assert rope_inv_freq(4, 100.0, band).tolist() == pytest.approx([1.0, 0.0427511], rel=1e-5)


def test_llama3_inv_freq_matches_meta_reference_loop():
    """Against a plain-Python transcription of Meta's reference apply_scaling (per frequency)."""
    scaling = RopeScaling(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=8192)
    freqs = [1.0 / (5e5 ** (i / 128)) for i in range(0, 128, 2)]
    expected = []
    low_wavelen, high_wavelen = 8192 / 1.0, 8192 / 4.0
    for f in freqs:
        wavelen = 2 * math.pi / f
        if wavelen < high_wavelen:
            expected.append(f)
        elif wavelen > low_wavelen:
            expected.append(f / 8.0)
        else:
            smooth = (8192 / wavelen - 1.0) / (4.0 - 1.0)
            expected.append((1 - smooth) * f / 8.0 + smooth * f)
    got = rope_inv_freq(128, 5e5, scaling).tolist()
    assert got == pytest.approx(expected, rel=1e-5)
    assert sum(e != f for e, f in zip(expected, freqs)) > 10  # the scaling moved many frequencies


def test_hf_rope_scaling_reads_the_original_context_from_max_position_embeddings():
    scaling = {k: v for k, v in _LLAMA3_SCALING.items() if k != "original_max_position_embeddings"}
    got = hf_rope_scaling({"rope_scaling": scaling, "max_position_embeddings": 300})
    assert got is not None and got.original_max_position_embeddings == 300


# -- training ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("tp", [1, 2])
def test_qwen3_trains_through_the_local_pipeline(tp):
    """One gradient pass and one optimiser step on a 2-stage pipeline (x tp): the gradient equals
    the single-process one (q/k norms included: under TP each rank sees only its heads' share), the
    loss is finite, every weight moved and TP replicas of the norms stay equal."""
    from stages.train.batch import build_global_batch
    from stages.train.engine import TrainSetup
    from stages.train.local import run_local_pipeline
    from stages.train.loss import LossConfig, grpo_microbatch_loss

    cfg = make_decoder_config(model_type="qwen3", num_hidden_layers=2, attention_bias=True)
    model = make_model(cfg)
    with torch.no_grad():  # make_model leaves norms at one
        gen = torch.Generator().manual_seed(1)
        for name, p in model.named_parameters():
            if name.endswith(("q_norm.weight", "k_norm.weight")):
                p.add_(torch.randn(p.shape, generator=gen) * _WEIGHT_STD)
    loss_cfg = LossConfig(clip_eps_low=0.2, clip_eps_high=0.28, kl_beta=0.1, temperature=0.9)
    batch = build_global_batch(make_rollout_arrays(model, num_groups=2, group_size=2), "token-mean", 0)
    model.zero_grad(set_to_none=True)
    loss, _ = grpo_microbatch_loss(model(batch.input_ids), batch.target, loss_cfg)
    loss.backward()
    expected = {name: p.grad.clone() for name, p in hf_named_parameters(model)}
    setup = TrainSetup(model=cfg, pipeline_parallel_size=2, num_microbatches=2, schedule="1f1b",
                       tensor_parallel_size=tp, loss=loss_cfg, max_grad_norm=0.0, timeout_s=60)
    before = hf_state(model)
    outputs = run_local_pipeline(setup, before, [batch, batch], calls=["grad", "train"])
    tol = 1e-5 if tp > 1 else 1e-6  # TP sums partial products in another order
    grads: dict[str, torch.Tensor] = {}
    for out in outputs:
        for name, g in out.grads[0].items():
            assert max_diff(g, expected[name]) <= tol, (out.rank, name)
            grads[name] = g
    assert set(grads) == set(expected) and any("q_norm" in n for n in grads)
    losses = {out.steps[1].metrics["loss"] for out in outputs if "loss" in out.steps[1].metrics}
    assert len(losses) == 1 and math.isfinite(losses.pop())  # every last-stage rank reports the same loss
    after: dict[str, torch.Tensor] = {}
    for out in outputs:
        for name, w in out.state.items():
            assert name not in after or max_diff(after[name], w) <= 1e-6, (out.rank, name)
            after[name] = w
    assert set(after) == set(before)
    assert all(max_diff(after[n], before[n]) > 0 for n in before)
