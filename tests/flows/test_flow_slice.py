"""Two levels, as kedro tests a pipeline: one worker function on a fixture store, and a slice of the
iteration (rollout -> reward and advantage) run in order through flows/tasks.py over a run folder,
each stage's output checked against an independent computation."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from flows import tasks
from flows.config import config_hash, load_config
from flows.iteration import step_layout
from flows.loop import run_folder
from stages.policy import DecoderConfig, build_stage, load_hf_state
from stages.policy.tokenizer import TextCodec
from stages.rollout import SamplingParams, generate
from stages.tasks.addition import answer_of, make_prompts
from storage.policies import load_model_folder
from storage.run_folder import CACHE_ENV

_OVERRIDES = ["warmup.steps=2", "task.prompts_per_step=8", "train.micro_batch_size=16", "run_name=slice"]
_ADV_EPS = 1e-6  # advantage.eps's default


@pytest.fixture
def step0(tmp_path, monkeypatch):
    """A run folder with policy v0 and an empty step 0."""
    monkeypatch.delenv(CACHE_ENV, raising=False)
    cfg = load_config("configs/tiny.yaml", [*_OVERRIDES, f"runs_dir={tmp_path}"])
    folder = run_folder(cfg).create()
    policy = tasks.make_base_policy(cfg, folder)
    store = folder.rollout_store()
    ref = store.create_step(0, step_layout(cfg), policy.version, config_hash(cfg))
    return cfg, folder, policy, store, ref


def test_base_policy_carries_the_real_max_positions(step0):
    cfg, folder, policy, _, _ = step0
    hf_config, _, _ = load_model_folder(policy.path, names=set())
    assert hf_config["max_position_embeddings"] == 7 + 6  # "<bos>99+99=" and 6 sampled tokens
    assert policy.path == f"{folder.policies}/v0" and folder.policy_store().is_complete(0)


def test_score_task_on_fixture_rows(step0):
    cfg, _, policy, store, ref = step0
    codec = TextCodec.from_json((load_model_folder(policy.path, names=set())[1]))
    G = cfg.rollout.group_size
    prompts = make_prompts(cfg.seed, 0, cfg.task.prompts_per_step, cfg.dataset.num_digits)
    # Group 0 answers right, group 1 answers "0": rewards 1 and 0 (0 only if the sum is not 0).
    width, new = store.layout(0).prompt_width, cfg.rollout.max_new_tokens
    rows = {"prompt_ids": np.full((2 * G, width), codec.pad_id), "prompt_len": np.zeros(2 * G),
            "tokens": np.full((2 * G, new), codec.pad_id), "length": np.zeros(2 * G)}
    for i in range(2 * G):
        p = prompts[i // G]
        ids, out = [codec.bos_id, *codec.encode(p)], [*codec.encode(answer_of(p) if i < G else "0"), codec.eos_id]
        rows["prompt_ids"][i, : len(ids)], rows["prompt_len"][i] = ids, len(ids)
        rows["tokens"][i, : len(out)], rows["length"][i] = out, len(out)
    store.write_rows(0, rows)
    metrics = tasks.score_task(cfg, ref, policy.path, 0, 2 * G)
    got = store.read(0, "reward", "advantage")
    expected = [1.0] * G + [float(answer_of(prompts[1]) == "0")] * G
    np.testing.assert_array_equal(got["reward"][: 2 * G], expected)
    # Every group's rewards are equal: its advantages are exactly 0.
    np.testing.assert_array_equal(got["advantage"][: 2 * G], np.zeros(2 * G))
    stats = metrics.statistics
    assert metrics.reward_failed == stats["reward_failed"] == 0.0
    assert stats["reward_mean"] == pytest.approx(np.mean(expected)) and stats["zero_variance_groups"] == 2.0


def test_rollout_reward_advantage_slice(step0):
    cfg, _, policy, store, ref = step0
    G, P = cfg.rollout.group_size, cfg.task.prompts_per_step
    roll = [tasks.rollout_task(cfg, ref, policy, lo, hi, "engine-0") for lo, hi in ((0, 4), (4, 8))]
    tasks.mark_stage_complete(ref, "rollout", *roll)
    scores = [tasks.score_task(cfg, ref, policy.path, lo, hi) for lo, hi in ((0, 4 * G), (4 * G, 8 * G))]
    stats = tasks.mark_scored(cfg, ref, *scores)
    assert store.completed(0) == {"rollout", "reward", "advantage"}
    assert store.attrs(0)["results_advantage"] == [stats.to_dict()]
    # The scoring tasks' advantages are those of the advantage task over the stored rewards, bit for bit.
    fused = store.read(0, "advantage")["advantage"]
    assert tasks.advantage_task(cfg, ref) == stats
    np.testing.assert_array_equal(store.read(0, "advantage")["advantage"], fused)

    a = store.read(0, "prompt_ids", "prompt_len", "tokens", "length", "group_id", "policy_version", "reward",
                   "advantage")
    np.testing.assert_array_equal(a["group_id"], np.repeat(np.arange(P), G))
    assert np.all(a["policy_version"] == 0)
    # Rollout: the second range equals the engine run by hand on those prompts with the seed mix.
    hf_config, tokenizer_json, tensors = load_model_folder(policy.path)
    codec = TextCodec.from_json(tokenizer_json)
    model = build_stage(DecoderConfig.from_hf(hf_config))
    load_hf_state(model, tensors)
    model.eval()
    texts = make_prompts(cfg.seed, 0, P, cfg.dataset.num_digits)[4:8]
    r = cfg.rollout
    direct = generate(model, [[codec.bos_id, *codec.encode(t)] for t in texts],
                      SamplingParams(G, r.max_new_tokens, r.temperature, r.top_p, (codec.eos_id,), codec.pad_id),
                      torch.Generator().manual_seed(cfg.seed * 1_000_003 + 0 * 1_009 + 4))
    np.testing.assert_array_equal(a["tokens"][4 * G:], direct.tokens)
    np.testing.assert_array_equal(a["length"][4 * G:], direct.length)
    # Reward: exact match of the decoded completion with the sum, written out here.
    sums = [str(int(x) + int(y)) for x, y in (p.rstrip("=").split("+") for p in
                                               np.repeat(make_prompts(cfg.seed, 0, P, cfg.dataset.num_digits), G))]
    completions = [codec.decode(a["tokens"][i, : a["length"][i]].tolist()) for i in range(P * G)]
    expected = [float(c.strip() == s) for c, s in zip(completions, sums)]
    np.testing.assert_array_equal(a["reward"], expected)
    # Advantage: (R - mean) / (std + eps) per group, in float64 numpy.
    grouped = a["reward"].astype(np.float64).reshape(P, G)
    adv = (grouped - grouped.mean(1, keepdims=True)) / (grouped.std(1, keepdims=True) + _ADV_EPS)
    np.testing.assert_allclose(a["advantage"], adv.reshape(-1), rtol=1e-6, atol=1e-6)
    assert stats.statistics["reward_mean"] == pytest.approx(float(np.mean(expected)))
    assert stats.statistics["zero_variance_groups"] == float((grouped.std(1) == 0).sum())
    assert sum(m.rollout_tokens for m in roll) == float(a["length"].sum())


def test_a_damaged_base_policy_cache_is_rebuilt_the_same(step0, tmp_path, caplog):
    cfg, folder, policy, _, _ = step0
    before = open(f"{policy.path}/model-00001-of-00001.safetensors", "rb").read()
    (tokenizer,) = Path(folder.cache_root).glob("base-*/v0/tokenizer.json")
    tokenizer.write_text(tokenizer.read_text()[:-10])  # truncated: the manifest's sha256 no longer holds
    other = run_folder(load_config("configs/tiny.yaml", [*_OVERRIDES, f"runs_dir={tmp_path}", "run_name=slice2"]))
    with caplog.at_level("WARNING", logger="flows.tasks"):
        again = tasks.make_base_policy(cfg, other.create())
    assert "rebuilding the base-policy cache" in caplog.text and "tokenizer.json" in caplog.text
    assert open(f"{again.path}/model-00001-of-00001.safetensors", "rb").read() == before
    other.policy_store().verify(0)
