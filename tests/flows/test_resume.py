"""Exact resume at the training rank: 2 steps, store the version (weights + optimiser state), a
fresh rank loads it with the v0 reference and takes step 3; weights and loss metrics equal an
uninterrupted 3-step rank's bit for bit. Single process (pp = 1), so it runs in seconds; the
run-level equality (killed drivers, Zarr, summary) is tests/flows/test_resume_kill.py."""

from __future__ import annotations

import os

import pytest
import torch

from conftest import make_decoder_config, make_model, make_rollout_arrays
from stages.policy import hf_state
from stages.train.batch import build_global_batch
from stages.train.engine import TrainRank, TrainSetup
from stages.train.loss import LossConfig
from stages.tcp_store import free_port
from storage.policies import PolicyStore, PolicyStoreError, load_model_folder

LOSS = LossConfig(clip_eps_low=0.2, clip_eps_high=0.28, kl_beta=0.5, temperature=1.0)


def _setup(cfg) -> TrainSetup:
    return TrainSetup(model=cfg, pipeline_parallel_size=1, num_microbatches=2, schedule="gpipe", lr=3e-2,
                      weight_decay=0.01, loss=LOSS, timeout_s=60.0)


def _rank(setup, tensors, reference=None) -> TrainRank:
    return TrainRank(setup, 0, f"tcp://127.0.0.1:{free_port()}", tensors, reference_tensors=reference)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """(uninterrupted per-step (weights, metrics), resumed step 3, resumed without optimiser state,
    resumed with the resumed version as reference)."""
    cfg = make_decoder_config()
    model = make_model(cfg)
    v0 = hf_state(model)
    batches = [build_global_batch(make_rollout_arrays(model, seed=s, noise=0.3), "token-mean", 0) for s in range(3)]
    store = PolicyStore(tmp_path_factory.mktemp("policy"))
    hf_config = cfg.to_hf()

    engine = _rank(_setup(cfg), v0)
    steps = []
    for i, batch in enumerate(batches):
        ref_logp = engine.batch_logp(batch, "reference_logp")
        metrics = engine.train_step(batch).metrics
        steps.append((engine.hf_state(), metrics, ref_logp))
        if i == 1:  # publish v2 as a run does: shards, optimiser state, then the manifest
            store.save_shard(2, 0, 1, engine.hf_state())
            store.save_optimizer_state(2, 0, engine.optimizer_state())
            store.finalize_policy(2, hf_config, "{}", 1)
    engine.close()

    def resume(with_optimizer: bool, reference_v0: bool):
        _, _, tensors = load_model_folder(store.version_path(2))
        r = _rank(_setup(cfg), tensors, v0 if reference_v0 else None)
        if with_optimizer:
            r.load_optimizer_state(store.load_optimizer_state(2, 0))
        ref_logp = r.batch_logp(batches[2], "reference_logp")
        m = r.train_step(batches[2]).metrics
        out = (r.hf_state(), m, ref_logp)
        r.close()
        return out

    return steps, resume(True, True), resume(False, True), resume(True, False), store


def _same(a: dict, b: dict) -> bool:
    return set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a)


def test_resumed_step_equals_uninterrupted_bit_for_bit(runs):
    steps, resumed, _, _, _ = runs
    weights, metrics, ref_logp = steps[2]
    assert _same(resumed[0], weights)
    assert (resumed[2] == ref_logp).all()  # the reference is v0, as in the uninterrupted run
    for key in ("loss", "kl", "clip_fraction", "grad_norm"):
        assert resumed[1][key] == metrics[key], key


def test_without_optimizer_state_or_v0_reference_it_differs(runs):
    """The controls: the comparison above can fail."""
    steps, _, fresh_adam, wrong_ref, _ = runs
    weights, metrics, ref_logp = steps[2]
    assert not _same(fresh_adam[0], weights)
    assert not (wrong_ref[2] == ref_logp).all()


def test_optimizer_state_files_and_manifest(runs):
    *_, store = runs
    assert store.optimizer_ranks(2) == 1
    state = store.load_optimizer_state(2, 0)
    assert all(k.rsplit(".", 1)[1] in ("exp_avg", "exp_avg_sq", "step") for k in state)
    assert float(state[next(k for k in state if k.endswith(".step"))]) == 2.0  # two AdamW steps taken
    store.verify(2)


def test_verify_names_a_changed_optimizer_file(runs, tmp_path):
    *_, store = runs
    import shutil

    copy = PolicyStore(tmp_path / "policy")
    shutil.copytree(store.version_path(2), copy.version_path(2))
    path = copy.optimizer_path(2, 0)
    data = bytearray(path.read_bytes())
    data[-1] ^= 1
    path.write_bytes(bytes(data))
    with pytest.raises(PolicyStoreError, match=r"optim/rank0.safetensors .*does not match"):
        copy.verify(2)
    os.remove(path)
    with pytest.raises(PolicyStoreError, match="is missing"):
        copy.verify(2)
