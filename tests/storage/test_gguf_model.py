"""A GGUF file converted into an HF folder (storage/gguf_model.py), without the 98 MB package: each
test builds a tiny GGUF of its own, the way llama.cpp's convert_hf_to_gguf.py writes a Llama (tensor
names, q/k row permutation, byte-level BPE vocabulary and merges, chat template), from a random
transformers model, and checks the folder against that model, transformers' GGUF loader and the
runtime's loader and tokenizer."""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from conftest import random_hf_model
from stages.policy import DecoderConfig, build_stage, load_hf_state, stage_hf_names
from stages.policy.tokenizer import TextCodec
from storage import gguf_model
from storage.gguf_model import GGUFModelError, GGUFSource, PackagedGGUF, convert_gguf, locate_packaged_gguf
from storage.policies import load_model_folder

import gguf  # test dependencies: these checks fail, never skip, without them
import transformers

_LOGITS_ATOL = 1e-5  # fp32 logits of the same weights; the GGUF stores rms_norm_eps as float32
_SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")  # unk, bos, eos = pad: SmolLM2's ids 0, 1, 2
_CHAT_TEMPLATE = (  # SmolLM2's template with another system prompt
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\\nYou are a tiny test model<|im_end|>\\n' }}{% endif %}"
    "{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n'}}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
_PROMPTS = ("What is 23 + 58?", "Mina has 4 coins and buys 6 packs with 10 coins in each.",
            "A train travels at 120 km per hour; how far does it go in 2 hours? Give \\boxed{} answers.")
# llama.cpp's names of a Llama's tensors (gguf-py's tensor_mapping.py), HF name -> GGUF name.
_GGUF_NAMES = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output",
               "input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
               "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
               "post_attention_layernorm": "ffn_norm", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
               "mlp.down_proj": "ffn_down"}


def make_bpe(texts: tuple[str, ...], vocab_size: int = 300) -> tuple[list[str], list[str]]:
    """(tokens by id, merges) of a byte-level BPE trained on ``texts``, specials first."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.train_from_iterator(texts * 20, trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=list(_SPECIALS), show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    vocab = tok.get_vocab()
    merges = json.loads(tok.to_str())["model"]["merges"]
    return sorted(vocab, key=vocab.get), [m if isinstance(m, str) else " ".join(m) for m in merges]


def llama_cpp_permute(w: np.ndarray, num_heads: int) -> np.ndarray:
    """convert_hf_to_gguf.py's LlamaModel.permute: each head's rotary halves interleaved."""
    return w.reshape(num_heads, 2, w.shape[0] // num_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def gguf_name(hf_name: str) -> str:
    stem, suffix = hf_name.rsplit(".", 1)
    if m := re.fullmatch(r"model\.layers\.(\d+)\.(.+)", stem):
        return f"blk.{m[1]}.{_GGUF_NAMES[m[2]]}.{suffix}"
    return f"{_GGUF_NAMES[stem]}.{suffix}"


def make_tiny_gguf(path: Path, seed: int = 0, tie_word_embeddings: bool = True):
    """A 2-layer Llama with every tensor random, written as an F32 GGUF at ``path``; returns the model."""
    tokens, merges = make_bpe(_PROMPTS + ("You are a tiny test model", "system user assistant"))
    config = transformers.LlamaConfig(
        vocab_size=len(tokens), hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-5, rope_theta=10000.0, max_position_embeddings=256,
        tie_word_embeddings=tie_word_embeddings, bos_token_id=1, eos_token_id=2, pad_token_id=2)
    model = random_hf_model(config, seed).eval()
    w = gguf.GGUFWriter(path, "llama")
    w.add_name("tiny test llama")
    w.add_context_length(config.max_position_embeddings)
    w.add_embedding_length(config.hidden_size)
    w.add_block_count(config.num_hidden_layers)
    w.add_feed_forward_length(config.intermediate_size)
    w.add_head_count(config.num_attention_heads)
    w.add_head_count_kv(config.num_key_value_heads)
    w.add_rope_dimension_count(config.head_dim)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(config.rms_norm_eps)
    w.add_vocab_size(config.vocab_size)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("smollm")
    w.add_token_list(tokens)
    w.add_token_types([gguf.TokenType.CONTROL if t in _SPECIALS else gguf.TokenType.NORMAL for t in tokens])
    w.add_token_merges(merges)
    w.add_unk_token_id(0)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_pad_token_id(2)
    w.add_add_bos_token(False)
    w.add_chat_template(_CHAT_TEMPLATE)
    for name, t in model.state_dict().items():
        if name == "lm_head.weight" and tie_word_embeddings:
            continue  # llama.cpp writes no output.weight for a tied head
        a = t.numpy().astype(np.float32)
        if name.endswith("q_proj.weight"):
            a = llama_cpp_permute(a, config.num_attention_heads)
        elif name.endswith("k_proj.weight"):
            a = llama_cpp_permute(a, config.num_key_value_heads)
        w.add_tensor(gguf_name(name), a)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return model


@dataclass(frozen=True)
class Tiny:
    gguf: Path
    model: "transformers.LlamaForCausalLM"
    folder: Path


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Tiny:
    root = tmp_path_factory.mktemp("gguf")
    model = make_tiny_gguf(root / "tiny.gguf")
    return Tiny(root / "tiny.gguf", model, convert_gguf(root / "tiny.gguf", root / "models" / "tiny"))


def make_ids(vocab_size: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, vocab_size, (2, 40), generator=torch.Generator().manual_seed(seed))


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    assert a.shape == b.shape
    return (a - b).abs().max().item()


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


# -- the folder ---------------------------------------------------------------------------------------
def test_the_folder_holds_the_original_weights_and_transformers_logits(tiny):
    """Every weight is the random model's, bit for bit (the q/k permutation undone); transformers
    gives the folder the logits of the GGUF it loads itself and of the original model."""
    tensors = load_file(str(tiny.folder / "model.safetensors"))
    original = {k: v for k, v in tiny.model.state_dict().items() if k != "lm_head.weight"}  # tied
    assert set(tensors) == set(original)
    assert all(tensors[k].dtype == torch.float32 and torch.equal(tensors[k], original[k]) for k in original)
    folder = transformers.LlamaForCausalLM.from_pretrained(tiny.folder).eval()
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tiny.gguf.parent, gguf_file=tiny.gguf.name,
                                                              dtype=torch.float32).eval()
    ids = make_ids(tiny.model.config.vocab_size)
    with torch.no_grad():
        logits = folder(ids).logits
        assert max_diff(logits, loaded(ids).logits) == 0.0
        assert max_diff(logits, tiny.model(ids).logits) <= _LOGITS_ATOL


def test_the_folder_is_a_plain_hf_folder_with_its_chat_template(tiny):
    config = json.loads((tiny.folder / "config.json").read_text())
    assert "quantization_config" not in config and config["tie_word_embeddings"] is True
    assert config["architectures"] == ["LlamaForCausalLM"] and config["num_key_value_heads"] == 2
    tok_config = json.loads((tiny.folder / "tokenizer_config.json").read_text())
    assert tok_config["chat_template"] == _CHAT_TEMPLATE
    specials = (tok_config["bos_token"], tok_config["eos_token"], tok_config["pad_token"])
    assert specials == ("<|im_start|>", "<|im_end|>", "<|im_end|>")
    assert json.loads((tiny.folder / "generation_config.json").read_text())["eos_token_id"] == 2
    assert not (tiny.folder / "chat_template.jinja").exists()


def test_the_runtime_loads_the_folder_with_transformers_logits(tiny):
    hf_config, _, tensors = load_model_folder(tiny.folder)
    ours = build_stage(DecoderConfig.from_hf(hf_config))
    ours.init_weights(torch.Generator().manual_seed(99))  # anything but the folder's values
    load_hf_state(ours, tensors)
    assert set(stage_hf_names(ours.eval())) == set(tensors)
    ids = make_ids(ours.cfg.vocab_size, seed=1)
    with torch.no_grad():
        assert max_diff(ours(ids), tiny.model(ids).logits) <= _LOGITS_ATOL


def test_the_runtime_tokenizer_gives_transformers_ids(tiny):
    """Chat-templated prompts: the runtime's TextCodec on the folder, transformers on the folder and
    transformers on the GGUF itself give the same ids; so do plain prompts without the template."""
    codec = TextCodec.from_policy_folder(tiny.folder)
    plain = TextCodec.from_policy_folder(tiny.folder, use_chat_template=False)
    from_folder = transformers.AutoTokenizer.from_pretrained(tiny.folder)
    from_gguf = transformers.AutoTokenizer.from_pretrained(tiny.gguf.parent, gguf_file=tiny.gguf.name)
    assert (codec.bos_id, codec.eos_ids, codec.pad_id) == (1, (2,), 2)
    for prompt in _PROMPTS:
        messages = [{"role": "user", "content": prompt}]
        ids = [list(t.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=True)
                    ["input_ids"]) for t in (from_folder, from_gguf)]
        assert codec.encode_prompt(prompt) == ids[0] == ids[1], prompt
        assert ids[0][:1] == [1] and len(ids[0]) < len(from_folder.apply_chat_template(messages, tokenize=False))
        assert plain.encode_prompt(prompt) == from_folder(prompt)["input_ids"] == from_gguf(prompt)["input_ids"]
        assert codec.decode(codec.encode(prompt)) == prompt


# -- the cache and the record -------------------------------------------------------------------------
def test_source_json_records_the_gguf_and_every_file(tiny):
    record = json.loads((tiny.folder / gguf_model.SOURCE_FILE).read_text())
    assert record["gguf"] == {"file": "tiny.gguf", "sha256": sha256(tiny.gguf),
                              "num_bytes": tiny.gguf.stat().st_size}
    assert record["package"] is None and record["converter"]["transformers"] == transformers.__version__
    written = sorted(p.name for p in tiny.folder.iterdir() if p.name != gguf_model.SOURCE_FILE)
    assert sorted(record["files"]) == written and "model.safetensors" in written
    for name, entry in record["files"].items():
        assert entry == {"sha256": sha256(tiny.folder / name), "num_bytes": (tiny.folder / name).stat().st_size}
    assert [p.name for p in tiny.folder.parent.iterdir()] == ["tiny"]  # no partial folder left beside


def test_a_converted_folder_is_reused_not_rewritten(tiny, monkeypatch):
    before = {p.name: p.stat().st_mtime_ns for p in tiny.folder.iterdir()}

    def no_conversion(*args):
        raise AssertionError("converted again")

    monkeypatch.setattr(gguf_model, "_write_hf_folder", no_conversion)
    assert convert_gguf(tiny.gguf, tiny.folder) == tiny.folder
    assert {p.name: p.stat().st_mtime_ns for p in tiny.folder.iterdir()} == before


def test_a_folder_of_another_gguf_or_of_nobody_is_not_written_over(tiny, tmp_path):
    other = tmp_path / "other.gguf"
    make_tiny_gguf(other, seed=1)
    with pytest.raises(GGUFModelError, match="holds a conversion of another GGUF file"):
        convert_gguf(other, tiny.folder)
    (tmp_path / "mine").mkdir()
    with pytest.raises(GGUFModelError, match=r"not a converted model folder \(no SOURCE.json\)"):
        convert_gguf(other, tmp_path / "mine")


def test_a_changed_folder_is_refused(tiny, tmp_path):
    import shutil

    copy = tmp_path / "copy"
    shutil.copytree(tiny.folder, copy)
    with open(copy / "model.safetensors", "r+b") as fh:
        fh.truncate(1000)
    with pytest.raises(GGUFModelError, match="model.safetensors is missing or not the size"):
        convert_gguf(tiny.gguf, copy)


# -- the package and bad files ------------------------------------------------------------------------
def test_a_missing_package_says_make_model(monkeypatch, capsys):
    from flows.cli import main

    monkeypatch.setitem(gguf_model.PACKAGED_MODELS, "absent", PackagedGGUF("grpoflow-absent-model", "m.gguf"))
    with pytest.raises(GGUFModelError, match="grpoflow-absent-model, which is not installed: run `make model`"):
        locate_packaged_gguf("absent")
    assert main(["model", "fetch", "absent"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "make model" in err[0]
    with pytest.raises(GGUFModelError, match="unknown model 'nope'; known: .*smollm2-135m-instruct"):
        locate_packaged_gguf("nope")


def test_a_packaged_gguf_is_found_and_recorded(tiny, tmp_path, monkeypatch):
    """A distribution installed the way pip installs a wheel (dist-info with RECORD), found by its
    file list and converted by the CLI with its name and version recorded."""
    from flows.cli import main

    site = tmp_path / "site"
    (site / "fake_model").mkdir(parents=True)
    (site / "fake_model" / "tiny.gguf").write_bytes(tiny.gguf.read_bytes())
    info = site / "fake_model-1.2.3.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: fake-model\nVersion: 1.2.3\n")
    (info / "RECORD").write_text("fake_model/tiny.gguf,,\nfake_model-1.2.3.dist-info/METADATA,,\n")
    monkeypatch.syspath_prepend(str(site))
    monkeypatch.setitem(gguf_model.PACKAGED_MODELS, "fake", PackagedGGUF("fake-model", "tiny.gguf"))
    assert locate_packaged_gguf("fake") == GGUFSource(site / "fake_model" / "tiny.gguf", "fake-model", "1.2.3")
    assert main(["model", "fetch", "fake", "--out", str(tmp_path / "out")]) == 0
    record = json.loads((tmp_path / "out" / gguf_model.SOURCE_FILE).read_text())
    assert record["package"] == {"name": "fake-model", "version": "1.2.3"}
    assert record["gguf"]["sha256"] == sha256(tiny.gguf)
    (site / "fake_model" / "tiny.gguf").unlink()
    with pytest.raises(GGUFModelError, match="the installed fake-model 1.2.3 holds no tiny.gguf"):
        locate_packaged_gguf("fake")


@pytest.mark.parametrize("damage, match", [
    ("missing", "no such GGUF file"),
    ("not-gguf", r"not a GGUF file \(it starts with b'PK\\x03\\x04'"),
    ("truncated", "transformers cannot load the GGUF file"),
])
def test_a_bad_gguf_is_one_line_and_leaves_nothing(tiny, tmp_path, damage, match):
    bad = tmp_path / "bad.gguf"
    if damage == "not-gguf":
        bad.write_bytes(b"PK\x03\x04 a zip, say")
    elif damage == "truncated":
        data = tiny.gguf.read_bytes()
        bad.write_bytes(data[: len(data) // 2])
    with pytest.raises(GGUFModelError, match=match) as info:
        convert_gguf(bad, tmp_path / "models" / "bad")
    assert len(str(info.value).splitlines()) == 1
    assert not (tmp_path / "models").exists() or not list((tmp_path / "models").iterdir())
