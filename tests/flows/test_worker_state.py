"""What a worker process holds between tasks (flows/worker.py ``WorkerState``): its rollout engines
behind the contract, codecs and prompt sources. A version loaded in place from memory that fails
half-way leaves the engine holding no version, so the next task loads its version whole instead of
generating from half-copied weights."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch

from conftest import make_decoder_config, make_model
from flows import worker
from flows.config import load_config
from flows.worker import WorkerState
from stages.data import DatasetConfig
from stages.policy import hf_state
from stages.rollout.contract import PolicyVersionError
from stages.rollout.engine import SamplingParams
from stages.tasks.addition import make_tokenizer_json
from storage.policies import PolicyStore


@pytest.fixture
def engine(tmp_path, monkeypatch):
    cfg = load_config("configs/tiny.yaml", [f"runs_dir={tmp_path}", "cluster.weight_sync=memory"])
    model_cfg = make_decoder_config()
    store = PolicyStore(tmp_path / "policy")
    states = {v: hf_state(make_model(model_cfg, seed=v)) for v in (1, 2)}
    refs = {v: store.save_policy(v, model_cfg.to_hf(), make_tokenizer_json(), states[v]) for v in (1, 2)}
    home = WorkerState()
    monkeypatch.setattr(home, "received", lambda cfg, version: (None, "test: from disk"))
    return cfg, home, states, refs, monkeypatch


def test_a_failed_in_place_load_leaves_no_version_held(engine):
    cfg, home, states, refs, monkeypatch = engine
    held, load = home.engine_at(cfg, "e0", refs[1])
    model = held.backend.model
    assert load["weights_from"] == "disk" and held.version == 1

    # v2 arrives in memory, but one tensor has the wrong shape: the copy stops part-way.
    broken = dict(states[2])
    name = sorted(broken)[-1]
    broken[name] = torch.zeros(3, 3)
    received = SimpleNamespace(tensors=broken, tag=SimpleNamespace(version=2, content_hash=""),
                               stats=SimpleNamespace(seconds=0.0, num_bytes=0), copy_seconds=0.0)
    monkeypatch.setattr(home, "received", lambda cfg, version: (received, ""))
    with pytest.raises(ValueError, match=r"has shape \(3, 3\)"):
        home.engine_at(cfg, "e0", refs[2])
    assert held.version is None and held.backend.model is None
    params = SamplingParams(group_size=2, max_new_tokens=2)
    with pytest.raises(PolicyVersionError, match="holds no policy version"):
        held.generate(1, [[1, 5]], params, seed=0)

    # The next task for v1 loads it whole from disk: the half-copied model is not reused.
    monkeypatch.setattr(home, "received", lambda cfg, version: (None, "test: from disk"))
    again, load = home.engine_at(cfg, "e0", refs[1])
    assert load["weights_from"] == "disk" and again is held and again.backend.model is not model
    got = hf_state(again.backend.model)
    assert all(torch.equal(got[k], states[1][k]) for k in states[1])


def test_a_version_from_disk_loads_into_the_held_model_of_its_architecture(engine):
    cfg, home, states, refs, monkeypatch = engine
    first = home.engine_at(cfg, "e0", refs[1])[0].backend.model
    held, load = home.engine_at(cfg, "e0", refs[2])
    assert load["weights_from"] == "disk" and held.backend.model is first and held.version == 2
    got = hf_state(held.backend.model)
    assert all(torch.equal(got[k], states[2][k]) for k in states[2])
    # The same bytes again (a step that moved no weight): only tagged with the new version.
    same = PolicyStore(refs[1].path.rsplit("/", 1)[0]).save_policy(
        5, make_decoder_config().to_hf(), make_tokenizer_json(), states[2])
    held, load = home.engine_at(cfg, "e0", same)
    assert load == {"weights_from": "held", "weight_load_seconds": 0.0} and held.version == 5
    # Another architecture (another run's model on a shared engine) gets a model of its own.
    wide = make_decoder_config(hidden_size=48, head_dim=12)
    ref3 = PolicyStore(refs[1].path.rsplit("/", 1)[0]).save_policy(
        3, wide.to_hf(), make_tokenizer_json(), hf_state(make_model(wide, seed=3)))
    third = home.engine_at(cfg, "e0", ref3)[0].backend.model
    assert third is not first and third.cfg == wide


def test_other_engine_settings_build_another_engine(engine):
    """A run with other rollout settings on a live cluster gets an engine of its own; the old one is closed."""
    cfg, home, states, refs, monkeypatch = engine
    held, _ = home.engine_at(cfg, "e0", refs[1])
    assert home.engine(cfg, "e0") is held
    other = load_config("configs/tiny.yaml", [f"runs_dir={cfg.runs_dir}", "rollout.max_num_seqs=16"])
    fresh = home.engine(other, "e0")
    assert fresh is not held and fresh.version is None and held.version is None
    assert home.close_engines() == 1 and home.engines == {}


def _tokenizer_folder(path, text: str):
    path.mkdir(parents=True)
    (path / "tokenizer.json").write_text(text)
    return str(path)


def test_a_codec_is_loaded_once_per_tokenizer(tmp_path, monkeypatch):
    """The engines' and scorers' text codec is read once per tokenizer, not per version: keyed by the
    bytes of the files it is read from, so two run folders of one run name with other tokenizers,
    or a run folder deleted and made again with another one under the same paths, never share it."""
    loads = []
    monkeypatch.setattr(worker.TextCodec, "from_policy_folder",
                        classmethod(lambda cls, path, chat, system_prompt=None: loads.append(path) or object()))
    home = WorkerState()
    cfg = load_config("configs/tiny.yaml", [f"runs_dir={tmp_path}"])
    a, b = tmp_path / "a" / "tiny" / "policy", tmp_path / "b" / "tiny" / "policy"
    first = home.codec(cfg, _tokenizer_folder(a / "v0", "tokenizer one"))
    assert home.codec(cfg, _tokenizer_folder(a / "v7", "tokenizer one")) is first  # a later version
    other = home.codec(cfg, _tokenizer_folder(b / "v0", "tokenizer two"))  # the same run name elsewhere
    assert other is not first
    # The run folder made again with another tokenizer, the cluster (and this cache) still up.
    for version in ("v0", "v7"):
        (a / version / "tokenizer.json").unlink()
        (a / version).rmdir()
    again = home.codec(cfg, _tokenizer_folder(a / "v0", "tokenizer three"))
    assert again is not first and again is not other
    assert home.codec(cfg, str(a / "v0")) is again
    # A side file the codec reads (tokenizer_config.json) counts too.
    (a / "v0" / "tokenizer_config.json").write_text("{}")
    assert home.codec(cfg, str(a / "v0")) is not again
    assert loads == [str(a / "v0"), str(b / "v0"), str(a / "v0"), str(a / "v0")]


@pytest.fixture
def jsonl_prompts(tmp_path, monkeypatch):
    """(policy folder, write(addend): the data file with prompts "i+addend=", what the rollout task
    reads of a run's config) for a jsonl run (which needs an HF model folder besides), with empty
    codec and source caches."""
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
    return str(policy), write, cfg, WorkerState()


def test_prompts_are_read_again_once_the_data_file_changes(jsonl_prompts):
    """A worker opens the run's prompt source once and keeps it; a data file edited between two runs
    on one live cluster (a notebook) is read again, not served from the source opened before."""
    policy, write, cfg, home = jsonl_prompts
    first = [r.prompt for r in home.records(cfg, policy, 0, 0, 4)]
    assert [r.prompt for r in home.records(cfg, policy, 1, 0, 4)] == first and len(home.sources) == 1
    write(2)
    again = [r.prompt for r in home.records(cfg, policy, 0, 0, 4)]
    assert sorted(again) == [f"{i}+2=" for i in range(4)] and sorted(first) == [f"{i}+1=" for i in range(4)]
    assert len(home.sources) == 2


def test_tasks_take_the_data_stamp_the_step_was_made_with(jsonl_prompts, monkeypatch):
    """The driver stamps the prompt data's files as it makes a step and stores the stamp with the
    step; the tasks key their opened source on it, so a folder of many files is walked once a step,
    not by every task. A file edited before the next step is made is read at that step."""
    policy, write, cfg, home = jsonl_prompts
    walks = []
    stamp = worker.data_stamp(cfg)
    real = worker.dataset_stamp
    monkeypatch.setattr(worker, "dataset_stamp", lambda d: walks.append(d) or real(d))
    first = [r.prompt for r in home.records(cfg, policy, 0, 0, 4, stamp)]
    assert [r.prompt for r in home.records(cfg, policy, 1, 0, 4, stamp)] == first
    assert walks == [] and len(home.sources) == 1  # the step's stamp: no walk, one source
    write(2)
    assert worker.data_stamp(cfg) != stamp  # the next step's stamp, taken by the driver
    again = [r.prompt for r in home.records(cfg, policy, 2, 0, 4, worker.data_stamp(cfg))]
    assert sorted(again) == sorted(p.replace("+1=", "+2=") for p in first) and len(home.sources) == 2
    # A step stored without a stamp: the task takes one itself.
    walks.clear()
    assert [r.prompt for r in home.records(cfg, policy, 2, 0, 4)] == again and len(walks) == 1


def test_a_made_step_stores_the_data_stamp(tmp_path):
    from flows.iteration import prepare_step
    from flows.loop import run_folder

    cfg = load_config("configs/tiny.yaml", [f"runs_dir={tmp_path}", "run_name=stamp"])
    folder = run_folder(cfg)
    assert prepare_step(cfg, folder, 0, 0)
    assert folder.rollout_store().attrs(0)["data_stamp"] == worker.data_stamp(cfg)
