"""A catalogue of bad inputs: each is refused by ``run`` before any work starts (no cluster),
with one line naming the key, file or sample, and leaves the run folder byte for byte as it was.

The run folder is built by hand (run.json, one complete Zarr step, policy v0 and v1 with its
optimiser state), so every case takes milliseconds."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

import numpy as np
import pytest

from conftest import make_decoder_config, make_model
from flows.config import ConfigError, config_hash, config_to_dict, load_config
from flows.iteration import step_layout
from flows.loop import fresh_run, run, run_folder
from flows.preflight import config_differences, preflight
from stages.policy import hf_state
from stages.tasks.addition import make_tokenizer_json
from storage.rollouts import ARRAYS

BASE = ["task.prompts_per_step=8", "train.micro_batch_size=16", "warmup.steps=5", "iterations=3"]


def _hf_folder(path: Path, model_cfg=None) -> Path:
    model_cfg = model_cfg or make_decoder_config()
    from safetensors.torch import save_file

    path.mkdir(parents=True)
    (path / "config.json").write_text(json.dumps(model_cfg.to_hf()))
    (path / "tokenizer.json").write_text(make_tokenizer_json())
    save_file({k: v.contiguous() for k, v in hf_state(make_model(model_cfg)).items()}, str(path / "model.safetensors"))
    return path


@pytest.fixture(scope="module")
def template(tmp_path_factory):
    """(runs_dir template, base overrides, HF folder template): a run that has finished step 0."""
    root = tmp_path_factory.mktemp("bad")
    runs = root / "runs"
    cfg = load_config("configs/tiny.yaml", [*BASE, f"runs_dir={runs}", "run_name=r"])
    folder = run_folder(cfg).create()
    folder.save_run_state({"config": config_to_dict(cfg), "config_hash": config_hash(cfg), "mlflow_run_id": "x"})
    store = folder.rollout_store()
    layout = step_layout(cfg)
    store.create_step(0, layout, 0, config_hash(cfg))
    rng = np.random.default_rng(0)
    for name, (dtype, kind) in ARRAYS.items():
        tail = {"": (), "prompt": (layout.prompt_width,), "gen": (layout.max_new_tokens,)}[kind]
        values = rng.integers(0, 2, (layout.num_samples, *tail)).astype(dtype)
        store.write(0, name, values)
    for stage in ("rollout", "reward", "reference", "advantage", "train", "publish"):
        store.mark_complete(0, stage)
    model_cfg = make_decoder_config()
    tensors = hf_state(make_model(model_cfg))
    policies = folder.policy_store()
    policies.save_policy(0, model_cfg.to_hf(), "{}", tensors)
    policies.save_shard(1, 0, 1, tensors)
    policies.save_optimizer_state(1, 0, {"0.w.exp_avg": tensors["model.norm.weight"]})
    policies.finalize_policy(1, model_cfg.to_hf(), "{}", 1)
    hf = _hf_folder(root / "hf")
    return runs, hf


@pytest.fixture
def env(template, tmp_path):
    """A private copy: (runs_dir, run folder, HF folder)."""
    runs_t, hf_t = template
    runs, hf = tmp_path / "runs", tmp_path / "hf"
    shutil.copytree(runs_t, runs)
    shutil.copytree(hf_t, hf)
    return runs, runs / "r", hf


def _tree_hash(root: Path) -> str:
    h = hashlib.sha256()
    for p in sorted(root.rglob("*")):
        h.update(str(p.relative_to(root)).encode())
        if p.is_file():
            h.update(p.read_bytes())
    return h.hexdigest()


def _corrupt(path: Path, how: str = "flip") -> None:
    data = bytearray(path.read_bytes())
    if how == "flip":
        data[len(data) // 2] ^= 0xFF
        path.write_bytes(bytes(data))
    else:
        path.write_bytes(bytes(data[: len(data) // 2]))


def _chunk(run: Path, array: str) -> Path:
    return next(p for p in sorted((run / "rollouts.zarr" / "step_0" / array).rglob("*"))
                if p.is_file() and p.name != "zarr.json")


def _nan_weight(hf: Path) -> None:
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(hf / "model.safetensors"))
    tensors["model.norm.weight"][0] = float("nan")
    save_file(tensors, str(hf / "model.safetensors"))


def _edit_json(path: Path, **changes) -> None:
    data = json.loads(path.read_text())
    for k, v in changes.items():
        if v is None:
            data.pop(k, None)
        else:
            data[k] = v
    path.write_text(json.dumps(data))


# (case id, extra overrides (callable of the HF folder or a list), file edit (run, hf) -> None, message regex)
def _char_split_tokenizer() -> str:
    """The task's tokenizer, normalising "+" to "++": every prompt grows one token past the width."""
    tok = json.loads(make_tokenizer_json())
    tok["normalizer"] = {"type": "Replace", "pattern": {"String": "+"}, "content": "++"}
    return json.dumps(tok)


def _model(**changes):
    return lambda run, hf: _edit_json(hf / "config.json", **changes)


CASES = [
    # -- reward functions --------------------------------------------------------------------------
    ("unknown-reward", ["reward.functions=[no_such_reward]"], None, r"reward.functions\[0\]='no_such_reward' is not"),
    ("second-reward-unknown", ["reward.functions=[exact_match,nope]"], None, r"reward.functions\[1\]='nope'"),
    ("reward-module-missing", ["reward.functions=[no_such_pkg.mod:fn]"], None, r"module 'no_such_pkg.mod' not found"),
    ("reward-attr-missing", ["reward.functions=[stages.reward:nothing_here]"], None, r"has no attribute 'nothing_here'"),
    ("reward-not-callable", ["reward.functions=[stages.reward:REWARDS]"], None, r"not callable"),
    ("reward-empty", ["reward.functions=[]"], None, r"reward.functions is empty"),
    # -- model folders -----------------------------------------------------------------------------
    ("model-missing", ["model.path=/nonexistent/model"], None, r"model.path=/nonexistent/model: no such folder"),
    ("model-is-file", "file", None, r"model.path=.*config.json: no such folder"),
    ("model-nan-weight", "hf", lambda run, hf: _nan_weight(hf), r"tensor model.norm.weight in model.safetensors holds NaN"),
    ("eval-file-missing", ["eval.path=/nowhere/heldout.jsonl"], None, r"eval.path: .*/nowhere/heldout.jsonl"),
    ("eval-reward-unknown", ["eval.path=/nowhere/heldout.jsonl", "eval.functions=[no_such_reward]"], None,
     r"eval.functions\[0\]='no_such_reward'"),
    ("packaged-model-not-fetched", ["model.path=/nowhere/smollm2-135m-instruct"], None,
     r"model.path=/nowhere/smollm2-135m-instruct: no such folder \(`grpoflow model fetch smollm2-135m-instruct"),
    ("draft-missing", ["rollout.draft_path=/nowhere/draft"], None, r"rollout.draft_path: .*/nowhere/draft: no such folder"),
    ("model-no-config", "hf", lambda run, hf: os.remove(hf / "config.json"), r"no config.json"),
    ("model-config-not-json", "hf", lambda run, hf: (hf / "config.json").write_text("{oops"), r"config.json is not valid JSON"),
    ("model-config-list", "hf", lambda run, hf: (hf / "config.json").write_text("[1, 2]"), r"config.json is not valid JSON: not a JSON object"),
    ("model-type-unsupported", "hf", _model(model_type="gpt2"), r"config.json: .*gpt2"),
    ("model-no-hidden-size", "hf", _model(hidden_size=None), r"config.json: .*hidden_size"),
    ("model-sliding-window", "hf", _model(model_type="qwen2", use_sliding_window=True), r"sliding-window"),
    ("model-no-tokenizer", "hf", lambda run, hf: os.remove(hf / "tokenizer.json"), r"no tokenizer.json"),
    ("model-no-weights", "hf", lambda run, hf: os.remove(hf / "model.safetensors"), r"weights file model.safetensors is missing"),
    ("model-index-bad-json", "hf", lambda run, hf: (hf / "model.safetensors.index.json").write_text("{"),
     r"model.safetensors.index.json is unreadable"),
    ("model-index-names-missing-file", "hf", lambda run, hf: (hf / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {"model.norm.weight": "model-00001-of-00002.safetensors"}})),
     r"weights file model-00001-of-00002.safetensors is missing"),
    ("model-weights-truncated", "hf", lambda run, hf: _corrupt(hf / "model.safetensors", "truncate"),
     r"model.safetensors is not a readable safetensors file"),
    ("model-weights-garbage", "hf", lambda run, hf: (hf / "model.safetensors").write_bytes(b"\xff" * 64),
     r"model.safetensors is not a readable safetensors file"),
    ("model-wrong-shape", "hf", _model(intermediate_size=64), r"tensor model.layers.0.mlp.\w+_proj.weight has shape \[\d+, \d+\], config.json implies"),
    ("model-wrong-vocab", "hf", _model(vocab_size=99), r"tensor (lm_head|model.embed_tokens).weight has shape \[17, 32\], config.json implies \[99, 32\]"),
    ("model-more-layers", "hf", _model(num_hidden_layers=5), r"tensor model.layers.4.\S+ is missing"),
    ("model-tokenizer-ids-past-vocab", "hf", lambda run, hf: _edit_json(hf / "tokenizer.json", model={
        **json.loads(make_tokenizer_json())["model"], "vocab": {**json.loads(make_tokenizer_json())["model"]["vocab"],
                                                                 "-": 20}}),
     r"tokenizer.json has token id 20, the model's vocabulary \(config.json vocab_size\) ends at 16"),
    ("model-tokenizer-not-json", "hf", lambda run, hf: (hf / "tokenizer.json").write_text("{"), r"tokenizer.json cannot be used"),
    ("prompt-wider-than-width", "hf", lambda run, hf: (hf / "tokenizer.json").write_text(_char_split_tokenizer()),
     r"prompts take up to \d+ tokens under model.path's tokenizer, the step layout's prompt width is 7"),
    # -- an existing run folder with another config ------------------------------------------------
    ("config-lr-changed", ["train.lr=0.1"], None, r"started with a different config: train.lr differ; run with --new"),
    ("config-seed-and-group", ["seed=3", "rollout.group_size=4"], None, r"rollout.group_size, seed differ"),
    ("config-dataset-changed", ["dataset.num_digits=3"], None, r"dataset.num_digits differ"),
    ("run-json-corrupt", [], lambda run, hf: (run / "run.json").write_text("{"), r"cannot read .*run.json"),
    ("run-json-no-config", [], lambda run, hf: _edit_json(run / "run.json", config=None), r"run.json holds no config"),
    ("run-json-list", [], lambda run, hf: (run / "run.json").write_text("[]"),
     r"run.json holds a JSON list, not the run's state object"),
    ("override-not-yaml", ["train.lr=[1"], None, r"override 'train.lr=\[1': not valid YAML: did not find expected"),
    ("run-json-missing", [], lambda run, hf: os.remove(run / "run.json"), r"holds steps but no run.json"),
    # -- the Zarr store ----------------------------------------------------------------------------
    ("zarr-attrs-corrupt", [], lambda run, hf: (run / "rollouts.zarr/step_0/zarr.json").write_text("{"),
     r"rollout step 0 .*unreadable attributes"),
    ("zarr-chunk-truncated", [], lambda run, hf: _corrupt(_chunk(run, "tokens"), "truncate"),
     r"rollout step 0 .* is corrupt or truncated"),
    ("zarr-chunk-garbage", [], lambda run, hf: _corrupt(_chunk(run, "reward"), "flip"),
     r"rollout step 0 .* is corrupt or truncated"),
    ("zarr-chunk-deleted", [], lambda run, hf: os.remove(_chunk(run, "tokens")),
     r"rollout step 0 .* is damaged: .*step_0/tokens no longer matches the digest stored when stage rollout "
     r"completed: 1 of its \d+ files are missing, which Zarr would read as zeros"),
    ("zarr-ref-chunk-deleted", [], lambda run, hf: os.remove(_chunk(run, "ref_logp")),
     r"step_0/ref_logp no longer matches the digest stored when stage reference completed"),
    ("zarr-array-meta-deleted", [], lambda run, hf: os.remove(run / "rollouts.zarr/step_0/advantage/zarr.json"),
     r"rollout step 0 .* is corrupt or truncated"),
    ("zarr-layout-changed", [], lambda run, hf: _edit_json(run / "rollouts.zarr/step_0/zarr.json", attributes={
        **json.loads((run / "rollouts.zarr/step_0/zarr.json").read_text())["attributes"], "group_size": 4}),
     r"rollout step 0 .*another layout"),
    # -- policy versions ---------------------------------------------------------------------------
    ("policy-shard-changed", [], lambda run, hf: _corrupt(run / "policy/v1/model-00001-of-00001.safetensors"),
     r"policy v1: the shards in .* do not match the manifest's sha256"),
    ("policy-shard-truncated", [], lambda run, hf: _corrupt(run / "policy/v0/model-00001-of-00001.safetensors", "truncate"),
     r"policy v0: the shards .* do not match"),
    ("policy-shard-deleted", [], lambda run, hf: os.remove(run / "policy/v1/model-00001-of-00001.safetensors"),
     r"policy v1: shard .* is missing"),
    ("policy-manifest-corrupt", [], lambda run, hf: (run / "policy/v1/grpoflow.json").write_text("{"),
     r"policy v1: unreadable manifest"),
    ("policy-optimizer-changed", [], lambda run, hf: _corrupt(run / "policy/v1/optim/rank0.safetensors"),
     r"policy v1: optimiser state .*rank0.safetensors is missing or does not match"),
    ("policy-config-edited", [], lambda run, hf: _edit_json(run / "policy/v1/config.json", rms_norm_eps=0.1),
     r"policy v1: .*v1/config.json is missing or does not match the manifest's sha256"),
    ("policy-tokenizer-edited", [], lambda run, hf: (run / "policy/v1/tokenizer.json").write_text('{"x": 1}'),
     r"policy v1: .*v1/tokenizer.json is missing or does not match"),
    ("policy-v0-tokenizer-deleted", [], lambda run, hf: os.remove(run / "policy/v0/tokenizer.json"),
     r"policy v0: .*v0/tokenizer.json is missing"),
    ("policy-optimizer-deleted", [], lambda run, hf: os.remove(run / "policy/v1/optim/rank0.safetensors"),
     r"policy v1: optimiser state .*rank0.safetensors is missing"),
]


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_bad_input_is_refused_before_work(env, case):
    runs, run_dir, hf = env
    _, overrides, edit, message = case
    if overrides == "hf":
        overrides = [f"model.path={hf}"]
    elif overrides == "file":
        overrides = [f"model.path={hf / 'config.json'}"]
    if edit is not None:
        edit(run_dir, hf)
    before = _tree_hash(run_dir)
    # Refused when the config loads (ConfigError) or when the run starts (PreflightError, a ConfigError).
    with pytest.raises(ConfigError, match=message) as info:
        cfg = load_config("configs/tiny.yaml", [*BASE, f"runs_dir={runs}", "run_name=r", *overrides])
        run(cfg, progress=False)
    assert "\n" not in str(info.value)
    assert _tree_hash(run_dir) == before


def test_a_second_driver_of_the_run_is_refused_before_work(env):
    """The run folder is locked by its driver for its life: a second ``run`` on it (two
    ``grpoflow run`` of one config) is refused in one line naming the holder, before it reads or
    writes anything of the run."""
    from storage.run_folder import RunFolder, RunFolderError

    runs, run_dir, _ = env
    before = _tree_hash(run_dir)
    cfg = load_config("configs/tiny.yaml", [*BASE, f"runs_dir={runs}", "run_name=r"])
    with RunFolder.at(runs, "r").lock():
        with pytest.raises(RunFolderError, match=f"in use by another grpoflow process \\(pid {os.getpid()}\\)") as info:
            run(cfg, progress=False)
    assert "\n" not in str(info.value)
    assert _tree_hash(run_dir) == before


def test_iterations_past_the_data_are_refused_before_work(env):
    """dataset.epochs bounds the steps a file gives: a run asking for more is refused in one line
    before anything is written (it would fail at the first step past the data)."""
    runs, run_dir, hf = env
    data = hf / "data.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"{a}+1=", "answer": str(a + 1)}) + "\n" for a in range(10, 16)))
    before = _tree_hash(run_dir)
    dataset = [f"model.path={hf}", "dataset.kind=jsonl", f"dataset.path={data}", "dataset.epochs=1",
               "dataset.max_prompt_tokens=7", "task.prompts_per_step=2", "train.micro_batch_size=8", "run_name=data"]
    cfg = load_config("configs/tiny.yaml", [*BASE, f"runs_dir={runs}", *dataset, "iterations=4"])
    with pytest.raises(ConfigError, match=r"iterations=4 is past the 3 steps .*data.jsonl gives at dataset.epochs=1 "
                                          r"and task.prompts_per_step=2") as info:
        run(cfg, progress=False)
    assert "\n" not in str(info.value) and _tree_hash(run_dir) == before and not (runs / "data").exists()


def test_catalogue_size():
    assert len(CASES) >= 30


def test_good_inputs_pass(env):
    """The controls: the untouched folder and HF folder pass, and safe keys may change."""
    runs, run_dir, hf = env
    for extra in ([], ["iterations=7", "cluster.num_plain_workers=3", "mlflow.experiment=other"]):
        cfg = load_config("configs/tiny.yaml", [*BASE, f"runs_dir={runs}", "run_name=r", *extra])
        assert preflight(cfg, run_folder(cfg))["mlflow_run_id"] == "x"
    cfg = load_config("configs/tiny.yaml", [*BASE, f"runs_dir={runs}", "run_name=fresh", f"model.path={hf}"])
    assert preflight(cfg, run_folder(cfg)) is None


def test_config_differences_hand_worked():
    a = {"iterations": 3, "seed": 0, "train": {"lr": 0.1, "schedule": "1f1b"}, "cluster": {"colocated": False}}
    b = {"iterations": 9, "seed": 0, "train": {"lr": 0.2, "schedule": "1f1b"}, "cluster": {"colocated": True},
         "extra": 1}
    assert config_differences(a, b) == ["extra", "train.lr"]
    # What a run keeps on disk is not what it computes: the optimiser-state retention may change.
    a["train"]["keep_optimizer_state"], b["train"]["keep_optimizer_state"] = "latest", "all"
    assert config_differences(a, b) == ["extra", "train.lr"]


def test_new_starts_in_a_fresh_folder(env, capsys):
    runs, _, _ = env
    cfg = load_config("configs/tiny.yaml", [*BASE, f"runs_dir={runs}", "run_name=r"])
    assert fresh_run(cfg).run_name == "r-2"
    (runs / "r-2").mkdir()
    assert fresh_run(cfg).run_name == "r-3"


def test_cli_prints_a_config_refusal_in_one_line(env, capsys):
    from flows.cli import main

    runs, _, _ = env
    assert main(["run", "configs/tiny.yaml", *BASE, f"runs_dir={runs}", "run_name=r", "train.lr=0.5"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "train.lr differ" in err


@pytest.mark.parametrize("fn", ["nan_reward", "inf_reward"])
def test_nan_or_infinite_rewards_are_failed_samples(fn):
    from stages.reward import score_samples

    scored = score_samples(["1+1="] * 2, ["2", "3"], [f"tests.flows.nonfinite_rewards:{fn}", "exact_match"], 5.0)
    assert scored.failed.tolist() == [True, True] and scored.reward.tolist() == [0.0, 0.0]
