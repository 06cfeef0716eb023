"""The rollout engine's held model (flows/tasks.py ``_rollout_model``): a version loaded in place
from memory that fails half-way leaves the engine holding no version, so the next task loads its
version whole instead of generating from half-copied weights."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch

from conftest import make_decoder_config, make_model
from flows import tasks, weight_sync
from flows.config import load_config
from stages.data import DatasetConfig
from stages.policy import hf_state
from stages.tasks.addition import make_tokenizer_json
from storage.policies import PolicyStore


@pytest.fixture
def engine(tmp_path, monkeypatch):
    cfg = load_config("configs/tiny.yaml", [f"runs_dir={tmp_path}", "cluster.weight_sync=memory"])
    model_cfg = make_decoder_config()
    store = PolicyStore(tmp_path / "policy")
    states = {v: hf_state(make_model(model_cfg, seed=v)) for v in (1, 2)}
    refs = {v: store.save_policy(v, model_cfg.to_hf(), make_tokenizer_json(), states[v]) for v in (1, 2)}
    monkeypatch.setattr(weight_sync, "received_version", lambda cfg, version: (None, "test: from disk"))
    key = "engine-under-test"
    yield cfg, key, states, refs, monkeypatch
    tasks._ROLLOUT_MODELS.pop(key, None)
    tasks._ROLLOUT_VERSIONS.pop(key, None)


def test_a_failed_in_place_load_leaves_no_version_held(engine):
    cfg, key, states, refs, monkeypatch = engine
    model, _, load = tasks._rollout_model(cfg, key, refs[1])
    assert load["weights_from"] == "disk" and tasks._ROLLOUT_VERSIONS[key] == 1

    # v2 arrives in memory, but one tensor has the wrong shape: the copy stops part-way.
    broken = dict(states[2])
    name = sorted(broken)[-1]
    broken[name] = torch.zeros(3, 3)
    received = SimpleNamespace(tensors=broken)
    monkeypatch.setattr(weight_sync, "received_version", lambda cfg, version: (received, ""))
    with pytest.raises(ValueError, match=r"has shape \(3, 3\)"):
        tasks._rollout_model(cfg, key, refs[2])
    assert key not in tasks._ROLLOUT_MODELS and key not in tasks._ROLLOUT_VERSIONS
    with pytest.raises(RuntimeError, match="holds policy vNone"):
        tasks._check_engine_version(key, 1)

    # The next task for v1 loads it whole from disk: the half-copied model is not reused.
    monkeypatch.setattr(weight_sync, "received_version", lambda cfg, version: (None, "test: from disk"))
    again, _, load = tasks._rollout_model(cfg, key, refs[1])
    assert load["weights_from"] == "disk" and again is not model
    got = hf_state(again)
    assert all(torch.equal(got[k], states[1][k]) for k in states[1])


def test_a_version_from_disk_loads_into_the_held_model_of_its_architecture(engine):
    cfg, key, states, refs, monkeypatch = engine
    first, _, _ = tasks._rollout_model(cfg, key, refs[1])
    second, _, load = tasks._rollout_model(cfg, key, refs[2])
    assert load["weights_from"] == "disk" and second is first and tasks._ROLLOUT_VERSIONS[key] == 2
    got = hf_state(second)
    assert all(torch.equal(got[k], states[2][k]) for k in states[2])
    # Another architecture (another run's model on a shared engine) gets a model of its own.
    wide = make_decoder_config(hidden_size=48, head_dim=12)
    ref3 = PolicyStore(refs[1].path.rsplit("/", 1)[0]).save_policy(
        3, wide.to_hf(), make_tokenizer_json(), hf_state(make_model(wide, seed=3)))
    third, _, _ = tasks._rollout_model(cfg, key, ref3)
    assert third is not second and third.cfg == wide


def _tokenizer_folder(path, text: str):
    path.mkdir(parents=True)
    (path / "tokenizer.json").write_text(text)
    return str(path)


def test_a_codec_is_loaded_once_per_tokenizer(tmp_path, monkeypatch):
    """The engines' and scorers' text codec is read once per tokenizer, not per version: keyed by the
    bytes of the files it is read from, so two run folders of one run name with other tokenizers,
    or a run folder deleted and made again with another one under the same paths, never share it."""
    loads = []
    monkeypatch.setattr(tasks.TextCodec, "from_policy_folder",
                        classmethod(lambda cls, path, chat: loads.append(path) or object()))
    monkeypatch.setattr(tasks, "_CODECS", {})
    cfg = load_config("configs/tiny.yaml", [f"runs_dir={tmp_path}"])
    a, b = tmp_path / "a" / "tiny" / "policy", tmp_path / "b" / "tiny" / "policy"
    first = tasks._codec(cfg, _tokenizer_folder(a / "v0", "tokenizer one"))
    assert tasks._codec(cfg, _tokenizer_folder(a / "v7", "tokenizer one")) is first  # a later version
    other = tasks._codec(cfg, _tokenizer_folder(b / "v0", "tokenizer two"))  # the same run name elsewhere
    assert other is not first
    # The run folder made again with another tokenizer, the cluster (and this cache) still up.
    for version in ("v0", "v7"):
        (a / version / "tokenizer.json").unlink()
        (a / version).rmdir()
    again = tasks._codec(cfg, _tokenizer_folder(a / "v0", "tokenizer three"))
    assert again is not first and again is not other
    assert tasks._codec(cfg, str(a / "v0")) is again
    # A side file the codec reads (tokenizer_config.json) counts too.
    (a / "v0" / "tokenizer_config.json").write_text("{}")
    assert tasks._codec(cfg, str(a / "v0")) is not again
    assert loads == [str(a / "v0"), str(b / "v0"), str(a / "v0"), str(a / "v0")]


@pytest.fixture
def jsonl_prompts(tmp_path, monkeypatch):
    """(policy folder, write(addend): the data file with prompts "i+addend=", what the rollout task
    reads of a run's config) for a jsonl run (which needs an HF model folder besides), with empty
    codec and source caches."""
    monkeypatch.setattr(tasks, "_CODECS", {})
    monkeypatch.setattr(tasks, "_SOURCES", {})
    policy = tmp_path / "policy" / "v0"
    policy.mkdir(parents=True)
    (policy / "tokenizer.json").write_text(make_tokenizer_json())
    data = tmp_path / "data.jsonl"

    def write(addend: int) -> None:
        data.write_text("".join(json.dumps({"prompt": f"{i}+{addend}=", "answer": str(i + addend)}) + "\n"
                                for i in range(4)))

    write(1)
    cfg = SimpleNamespace(dataset=DatasetConfig(kind="jsonl", path=str(data), shuffle=False),
                          task=SimpleNamespace(prompts_per_step=4))
    return str(policy), write, cfg


def test_prompts_are_read_again_once_the_data_file_changes(jsonl_prompts):
    """A worker opens the run's prompt source once and keeps it; a data file edited between two runs
    on one live cluster (a notebook) is read again, not served from the source opened before."""
    policy, write, cfg = jsonl_prompts
    first = [r.prompt for r in tasks._records(cfg, policy, 0, 0, 4)]
    assert [r.prompt for r in tasks._records(cfg, policy, 1, 0, 4)] == first and len(tasks._SOURCES) == 1
    write(2)
    again = [r.prompt for r in tasks._records(cfg, policy, 0, 0, 4)]
    assert sorted(again) == [f"{i}+2=" for i in range(4)] and sorted(first) == [f"{i}+1=" for i in range(4)]
    assert len(tasks._SOURCES) == 2


def test_tasks_take_the_data_stamp_the_step_was_made_with(jsonl_prompts, monkeypatch):
    """The driver stamps the prompt data's files as it makes a step and stores the stamp with the
    step; the tasks key their opened source on it, so a folder of many files is walked once a step,
    not by every task. A file edited before the next step is made is read at that step."""
    policy, write, cfg = jsonl_prompts
    walks = []
    stamp = tasks.data_stamp(cfg)
    real = tasks.dataset_stamp
    monkeypatch.setattr(tasks, "dataset_stamp", lambda d: walks.append(d) or real(d))
    first = [r.prompt for r in tasks._records(cfg, policy, 0, 0, 4, stamp)]
    assert [r.prompt for r in tasks._records(cfg, policy, 1, 0, 4, stamp)] == first
    assert walks == [] and len(tasks._SOURCES) == 1  # the step's stamp: no walk, one source
    write(2)
    assert tasks.data_stamp(cfg) != stamp  # the next step's stamp, taken by the driver
    again = [r.prompt for r in tasks._records(cfg, policy, 2, 0, 4, tasks.data_stamp(cfg))]
    assert sorted(again) == sorted(p.replace("+1=", "+2=") for p in first) and len(tasks._SOURCES) == 2
    # A step stored without a stamp: the task takes one itself.
    walks.clear()
    assert [r.prompt for r in tasks._records(cfg, policy, 2, 0, 4)] == again and len(walks) == 1


def test_a_made_step_stores_the_data_stamp(tmp_path):
    from flows.iteration import prepare_step
    from flows.loop import run_folder

    cfg = load_config("configs/tiny.yaml", [f"runs_dir={tmp_path}", "run_name=stamp"])
    folder = run_folder(cfg)
    assert prepare_step(cfg, folder, 0, 0)
    assert folder.rollout_store().attrs(0)["data_stamp"] == tasks.data_stamp(cfg)
