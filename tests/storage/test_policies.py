"""Policy versions as HF model folders: written by PolicyStore, read by transformers and by us."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
import transformers  # a test dependency: the parity checks fail, never skip, without it

from stages.policy import DecoderConfig, build_stage, hf_state, load_hf_state, stage_hf_names
from stages.tasks.addition import make_tokenizer_json
from storage import policies
from storage.policies import PolicyStore, PolicyStoreError, load_model_folder

_LOGITS_ATOL = 1e-5  # same fp32 weights, two implementations



def make_cfg(**overrides) -> DecoderConfig:
    fields = dict(vocab_size=15, hidden_size=16, intermediate_size=24, num_hidden_layers=3,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=6, rope_theta=300.0,
                  model_type="llama", bos_token_id=1, eos_token_id=2, pad_token_id=0)
    fields.update(overrides)
    return DecoderConfig(**fields)


def make_model(cfg: DecoderConfig, seed: int = 0, stage: int = 0, num_stages: int = 1):
    """A stage whose every tensor is random, biases and norms included."""
    full = build_stage(cfg)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in full.named_parameters():
            noise = torch.randn(p.shape, generator=gen) * 0.3
            p.copy_(1.0 + noise if name.endswith("norm.weight") else noise)
    if num_stages == 1:
        return full.eval()
    part = build_stage(cfg, stage, num_stages)
    load_hf_state(part, hf_state(full))
    return part.eval()


def make_ids(cfg: DecoderConfig) -> torch.Tensor:
    return torch.randint(0, cfg.vocab_size, (2, 7), generator=torch.Generator().manual_seed(1))


def assert_transformers_agrees(path: str, model, cfg: DecoderConfig) -> None:
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager").eval()
    assert type(hf_model).__name__ == cfg.to_hf()["architectures"][0]
    ids = make_ids(cfg)
    with torch.no_grad():
        assert (hf_model(ids).logits.float() - model(ids)).abs().max().item() <= _LOGITS_ATOL


@pytest.mark.parametrize("overrides", [
    pytest.param(dict(), id="llama"),
    pytest.param(dict(tie_word_embeddings=True, attention_bias=True), id="llama-tied-bias"),
    pytest.param(dict(model_type="qwen2", attention_bias=True), id="qwen2"),
])
def test_saved_policy_loads_in_transformers(tmp_path, overrides):
    cfg = make_cfg(**overrides)
    model = make_model(cfg)
    store = PolicyStore(tmp_path / "policy")
    ref = store.save_policy(0, cfg.to_hf(), make_tokenizer_json(), hf_state(model))
    assert ref.version == 0 and ref.path == str(store.version_path(0))
    assert ref.num_bytes > 0 and len(ref.sha256) == 64
    assert store.ref(0) == ref
    assert_transformers_agrees(ref.path, model, cfg)


@pytest.mark.parametrize("tied", [False, True])
def test_two_pipeline_shards_load_in_transformers(tmp_path, tied):
    cfg = make_cfg(tie_word_embeddings=tied, model_type="qwen2", attention_bias=True)
    store = PolicyStore(tmp_path)
    stages = [make_model(cfg, stage=s, num_stages=2) for s in range(2)]
    for s, stage in enumerate(stages):  # each pipeline rank writes its own shard
        assert store.save_shard(3, s, 2, hf_state(stage)) > 0
    assert not store.is_complete(3)
    ref = store.finalize_policy(3, cfg.to_hf(), make_tokenizer_json(), 2, extra={"step": 3})
    assert store.is_complete(3) and store.latest_version() == 3
    index = json.loads((tmp_path / "v3" / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == set(stage_hf_names(stages[0])) | set(stage_hf_names(stages[1]))
    assert set(index["weight_map"].values()) == {"model-00001-of-00002.safetensors",
                                                 "model-00002-of-00002.safetensors"}
    manifest = json.loads((tmp_path / "v3" / "grpoflow.json").read_text())
    assert manifest["step"] == 3 and manifest["sha256"] == ref.sha256
    assert_transformers_agrees(ref.path, make_model(cfg), cfg)


def test_load_model_folder_round_trips(tmp_path):
    cfg = make_cfg(tie_word_embeddings=True)
    tensors = hf_state(make_model(cfg))
    store = PolicyStore(tmp_path)
    ref = store.save_policy(1, cfg.to_hf(), make_tokenizer_json(), tensors)
    hf_config, tokenizer_json, loaded = load_model_folder(ref.path)
    assert hf_config == cfg.to_hf() and DecoderConfig.from_hf(hf_config) == cfg
    assert tokenizer_json == make_tokenizer_json()
    assert loaded.keys() == tensors.keys()
    for name, t in tensors.items():
        assert loaded[name].dtype == t.dtype and torch.equal(loaded[name], t), name
    # A pipeline stage reads only its own tensors.
    last = build_stage(cfg, 1, 2)
    _, _, part = load_model_folder(ref.path, names=set(stage_hf_names(last)))
    assert set(part) == set(stage_hf_names(last))
    load_hf_state(last, part)


def test_load_model_folder_names_the_folder(tmp_path):
    with pytest.raises(PolicyStoreError, match="nowhere"):
        load_model_folder(tmp_path / "nowhere")


def test_incomplete_version_is_never_listed(tmp_path):
    cfg = make_cfg()
    tensors = hf_state(make_model(cfg))
    store = PolicyStore(tmp_path)
    assert store.latest_version() is None
    with pytest.raises(PolicyStoreError, match="v0"):
        store.ref(0)
    store.save_policy(1, cfg.to_hf(), make_tokenizer_json(), tensors)
    store.save_shard(2, 0, 1, tensors)  # a writer died before finalize_policy
    store.save_shard(10, 0, 2, tensors)
    assert store.is_complete(1) and not store.is_complete(2) and not store.is_complete(10)
    assert store.latest_version() == 1
    with pytest.raises(PolicyStoreError, match="v2"):
        store.ref(2)
    # Finalizing with a shard missing fails and leaves the version incomplete.
    with pytest.raises(PolicyStoreError, match="model-00002-of-00002"):
        store.finalize_policy(10, cfg.to_hf(), make_tokenizer_json(), 2)
    assert store.latest_version() == 1


def test_manifest_hash_changes_with_the_weights(tmp_path):
    cfg = make_cfg()
    store = PolicyStore(tmp_path)
    a = store.save_policy(0, cfg.to_hf(), "", hf_state(make_model(cfg, seed=0)))
    b = store.save_policy(1, cfg.to_hf(), "", hf_state(make_model(cfg, seed=0)))
    c = store.save_policy(2, cfg.to_hf(), "", hf_state(make_model(cfg, seed=1)))
    assert a.sha256 == b.sha256 != c.sha256
    # The manifest's hash is the sha256 of the shard bytes (one shard here).
    shard = Path(a.path) / "model-00001-of-00001.safetensors"
    assert a.sha256 == hashlib.sha256(shard.read_bytes()).hexdigest()


def test_remove_from_drops_later_versions(tmp_path):
    cfg = make_cfg()
    store = PolicyStore(tmp_path)
    tensors = hf_state(make_model(cfg))
    for v in (0, 1, 2):
        store.save_policy(v, cfg.to_hf(), "", tensors)
    store.remove_from(1)
    assert store.latest_version() == 0 and not store.version_path(1).exists()


def test_drop_optimizer_state_keeps_the_version_verifiable_and_refuses_to_restart_from_it(tmp_path):
    cfg = make_cfg()
    store = PolicyStore(tmp_path / "policy")
    tensors = hf_state(make_model(cfg))
    state = {"0.w.exp_avg": torch.randn(5, 3), "0.w.exp_avg_sq": torch.rand(5, 3), "0.w.step": torch.tensor(4.0)}
    for v in (1, 2):
        store.save_shard(v, 0, 1, tensors)
        store.save_optimizer_state(v, 0, state)
        store.finalize_policy(v, cfg.to_hf(), make_tokenizer_json(), 1)
    store.save_policy(0, cfg.to_hf(), make_tokenizer_json(), tensors)  # v0: no optimiser state
    sha = store.ref(1).sha256
    freed = store.drop_optimizer_state(1)
    assert freed == (tmp_path / "policy" / "v2" / "optim" / "rank0.safetensors").stat().st_size > 0
    assert not (tmp_path / "policy" / "v1" / "optim").exists()
    assert store.verify(1).sha256 == sha  # the weights are untouched and still hash to the manifest
    assert store.optimizer_ranks(1) == 0
    with pytest.raises(PolicyStoreError, match=r"policy v1 no longer holds its optimiser state"):
        store.load_optimizer_state(1, 0)
    assert store.drop_optimizer_state(1) == 0 and store.drop_optimizer_state(0) == 0
    assert store.load_optimizer_state(0, 0) is None  # a fresh version is not a dropped one
    loaded = store.load_optimizer_state(2, 0)  # the other version keeps its state, bit for bit
    assert all(torch.equal(loaded[k], state[k]) for k in state)
    store.verify(2)


def test_a_dropped_optimiser_file_is_written_over_in_place_by_the_next_state(tmp_path, monkeypatch):
    written = []  # the files safetensors' save_file writes (a file written over in place is not one)
    monkeypatch.setattr(policies, "save_file", lambda t, path, **kw: (written.append(Path(path).name),
                                                                      save_file(t, path, **kw)))
    cfg = make_cfg()
    store = PolicyStore(tmp_path / "policy")
    tensors = hf_state(make_model(cfg))

    def state(seed: int, rows: int = 5) -> dict[str, torch.Tensor]:
        g = torch.Generator().manual_seed(seed)
        return {"0.w.exp_avg": torch.randn(rows, 3, generator=g), "0.w.exp_avg_sq": torch.rand(rows, 3, generator=g),
                "0.w.step": torch.tensor(float(seed)), "1.b.exp_avg": torch.randn(7, generator=g).bfloat16()}

    def publish(v: int, s: dict[str, torch.Tensor]) -> None:
        store.save_shard(v, 0, 1, tensors)
        store.save_optimizer_state(v, 0, s)
        store.finalize_policy(v, cfg.to_hf(), make_tokenizer_json(), 1)

    for v in (1, 2):
        publish(v, state(v))
    inode = store.optimizer_path(1, 0).stat().st_ino
    store.drop_optimizer_state(1)
    assert store.spare_path(0).stat().st_ino == inode
    written.clear()
    publish(3, state(3))
    path = store.optimizer_path(3, 0)
    assert path.stat().st_ino == inode and not store.spare_path(0).exists()  # the same file, written over
    assert written == ["model-00001-of-00001.tmp"]  # the shard only
    save_file(state(3), str(tmp_path / "fresh.safetensors"), metadata={"format": "pt"})
    assert path.read_bytes() == (tmp_path / "fresh.safetensors").read_bytes()  # what a fresh write holds
    store.verify(3)
    assert all(torch.equal(store.load_optimizer_state(3, 0)[k], v) for k, v in state(3).items())
    # A spare of other shapes, or one that is not a safetensors file, is not written over in place:
    # the state is written fresh, as it would be without a spare.
    store.drop_optimizer_state(2)
    publish(4, state(4, rows=6))
    store.drop_optimizer_state(3)
    store.spare_path(0).write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00not json at all")
    publish(5, state(5))
    assert written.count("rank0.tmp") == 2  # v4 and v5: written fresh
    for v, s in ((4, state(4, rows=6)), (5, state(5))):
        assert all(torch.equal(store.load_optimizer_state(v, 0)[k], t) for k, t in s.items())
        store.verify(v)


def test_a_version_carries_the_source_folders_tokenizer_files(tmp_path):
    """A base model whose chat template is its own file (chat_template.jinja, as transformers saves
    it) keeps it in every version: the engines' codec is read from the version folder."""
    from stages.policy.tokenizer import TextCodec

    source = tmp_path / "hf"
    source.mkdir()
    (source / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<eos>", "bos_token": "<bos>"}))
    template = "{% for m in messages %}<bos>{{ m['content'] }}{% endfor %}"
    (source / "chat_template.jinja").write_text(template)
    (source / "generation_config.json").write_text(json.dumps({"eos_token_id": 2}))
    cfg = make_cfg()
    model = make_model(cfg)
    ref = PolicyStore(tmp_path / "policy").save_policy(0, cfg.to_hf(), make_tokenizer_json(), hf_state(model),
                                                       source=source)
    for name in ("tokenizer_config.json", "chat_template.jinja", "generation_config.json"):
        assert (Path(ref.path) / name).read_text() == (source / name).read_text()
    assert TextCodec.from_policy_folder(ref.path).chat_template == template


def test_a_folder_without_a_readable_config_is_refused_in_one_line(tmp_path):
    """load_model_folder reads config.json through storage/model_folder.py, in the store's wording."""
    with pytest.raises(PolicyStoreError, match=rf"^cannot load the model folder {tmp_path}: no config.json"):
        load_model_folder(tmp_path)
    (tmp_path / "config.json").write_text("[1, 2]")
    with pytest.raises(PolicyStoreError, match=r"config.json is not valid JSON: not a JSON object$"):
        load_model_folder(tmp_path)
