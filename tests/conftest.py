"""Shared keyword factories for the tests."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
import pytest
import torch

from stages.policy import DecoderConfig, build_stage


def make_decoder_config(**overrides) -> DecoderConfig:
    fields = dict(vocab_size=17, hidden_size=32, intermediate_size=48, num_hidden_layers=4, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=8, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    fields.update(overrides)
    return DecoderConfig(**fields)


def make_model(cfg: DecoderConfig | None = None, seed: int = 0, std: float = 0.2):
    model = build_stage(cfg or make_decoder_config())
    model.init_weights(torch.Generator().manual_seed(seed), std=std)
    return model


def make_rollout_arrays(model, num_groups: int = 4, group_size: int = 4, prompt_width: int = 5,
                        max_new_tokens: int = 6, seed: int = 0, noise: float = 0.05) -> dict[str, np.ndarray]:
    """Stored-rollout arrays whose behaviour and reference log-probs are the model's own plus noise,
    as they are in a real step (ratios near 1, a small KL)."""
    from stages.train.batch import build_global_batch
    from stages.train.loss import token_logp

    rng = np.random.default_rng(seed)
    n = num_groups * group_size
    vocab = model.cfg.vocab_size
    arrays = dict(
        prompt_ids=rng.integers(3, vocab, (n, prompt_width)).astype(np.int32),
        prompt_len=rng.integers(2, prompt_width + 1, n).astype(np.int32),
        tokens=rng.integers(3, vocab, (n, max_new_tokens)).astype(np.int32),
        length=rng.integers(1, max_new_tokens + 1, n).astype(np.int32),
        behav_logp=np.zeros((n, max_new_tokens), np.float32),
        ref_logp=np.zeros((n, max_new_tokens), np.float32),
        advantage=rng.normal(size=n).astype(np.float32),
    )
    batch = build_global_batch(arrays, "token-mean", 0)
    with torch.no_grad():
        logp = token_logp(model(batch.input_ids), batch.target[..., 0], 1.0).numpy()
    for i in range(n):
        p, L = arrays["prompt_len"][i], arrays["length"][i]
        own = logp[i, p - 1 : p - 1 + L]
        arrays["behav_logp"][i, :L] = own + rng.normal(scale=noise, size=L)
        arrays["ref_logp"][i, :L] = own + rng.normal(scale=noise, size=L)
    return arrays


def random_hf_model(hf_config, seed: int = 0, std: float = 0.2):
    """transformers' model for ``hf_config`` with EVERY tensor random, norms near 1 (HF init leaves
    biases at zero and norm weights at one, which would hide a missing bias or norm)."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_config(hf_config, attn_implementation="eager")
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen) * std
            p.copy_(1.0 + noise if name.endswith("norm.weight") else noise)
    return model


@pytest.fixture
def decoder_config():
    return make_decoder_config()


@pytest.fixture(autouse=True)
def _one_torch_thread():
    # Tiny tensors: a thread pool only adds contention on a shared 2-core machine. Reset before
    # every test: a task function run in this process (flows/tasks.py) sets its phase's threads,
    # and a single-process reference computed on 2 threads rounds differently from 1-thread ranks.
    torch.set_num_threads(1)
    yield


def pids_where(field: str, value: int) -> set[int]:
    """Pids of the processes whose /proc/<pid>/stat ``field`` ("ppid" or "pgrp") is ``value``."""
    index = {"ppid": 1, "pgrp": 2}[field]  # counted after the ")" that ends the command name
    pids = set()
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            if int(stat.read_text().rsplit(")", 1)[1].split()[index]) == value:
                pids.add(int(stat.parent.name))
        except (OSError, ValueError, IndexError):
            continue  # gone meanwhile
    return pids


def log_finished_step(lineage, step: int, metrics: dict[str, float], version_out: int) -> str:
    """A finished MLflow child run of ``step`` with ``metrics``, as a run's step logs it
    (storage/lineage.py ``start_step``, from version_out - 1 to version_out); returns its run id."""
    with lineage.start_step(step, version_out - 1) as child:
        child.log_metrics(metrics)
        child.log_policy(version_out, f"policy/v{version_out}", "0" * 64)
    return child.run_id


TINY_CLI_ITERATIONS = 3
# One rollout engine on a worker of its own: the layout tests/flows/test_hosts.py spreads over hosts.
TINY_CLI_OVERRIDES = [f"iterations={TINY_CLI_ITERATIONS}", "run_name=r", "cluster.placement=decoupled",
                      "rollout.num_engines=1", "--quiet"]


@pytest.fixture(scope="session")
def tiny_cli_run(tmp_path_factory) -> Path:
    """The folder of an uninterrupted ``grpoflow run configs/tiny.yaml`` with TINY_CLI_OVERRIDES,
    run once for the tests that compare another path's run of it with this one."""
    import os
    import subprocess
    import sys

    root = tmp_path_factory.mktemp("tiny_cli")
    env = {**os.environ, "GRPOFLOW_CACHE": str(root / "cache"), "PYTHONPATH": os.getcwd()}
    done = subprocess.run([sys.executable, "-m", "flows.cli", "run", "configs/tiny.yaml", f"runs_dir={root}",
                           *TINY_CLI_OVERRIDES], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return root / "r"


def assert_loaded_from(run: Path, step: int, source: str, engines: int) -> list[dict]:
    """Every rollout task of ``step`` in run folder ``run`` got its weights from ``source`` ("disk"
    or "memory") or found that version held, and at least one loaded it. Any engine may take any of
    a step's prompt ranges, so an engine that takes two finds the version held at its second: which
    tasks load depends on scheduling, not what they load from. Returns the tasks that loaded."""
    from storage.rollouts import RolloutStore

    results = RolloutStore(run / "rollouts.zarr").attrs(step)["results_rollout"]
    sources = [r["weights_from"] for r in results]
    assert len(results) == engines and set(sources) <= {source, "held"} and source in sources, (step, sources)
    return [r for r in results if r["weights_from"] == source]


def assert_same_runs(a: Path, b: Path, steps: int, min_weight_files: int, skip_arrays: tuple[str, ...] = ()) -> None:
    """Two run folders hold steps 0 .. steps-1 with equal Zarr arrays, array by array (but
    ``skip_arrays``), and byte-equal policy safetensors files where both hold them (at least
    ``min_weight_files``); a file only one holds is optimiser state the other deleted."""
    import zarr  # here, so that the stages' tests import this file where Zarr is not installed

    za = zarr.open_group(str(a / "rollouts.zarr"), mode="r")
    zb = zarr.open_group(str(b / "rollouts.zarr"), mode="r")
    names = [f"step_{k}" for k in range(steps)]
    assert sorted(za.group_keys()) == sorted(zb.group_keys()) == names
    for step in names:
        assert sorted(za[step].array_keys()) == sorted(zb[step].array_keys())
        for name in sorted(set(za[step].array_keys()) - set(skip_arrays)):
            np.testing.assert_array_equal(za[step][name][:], zb[step][name][:], err_msg=f"{step}/{name}")

    def weights(run_dir: Path) -> dict[str, str]:
        return {str(p.relative_to(run_dir)): hashlib.sha256(p.read_bytes()).hexdigest()
                for p in sorted((run_dir / "policy").rglob("*.safetensors"))}

    def dropped(run_dir: Path, rel: str) -> bool:
        """``rel`` is optimiser state that run deleted (train.keep_optimizer_state=latest)."""
        parts = Path(rel).parts  # policy/v<k>/optim/rank<r>.safetensors
        manifest = run_dir / parts[0] / parts[1] / "grpoflow.json"
        return len(parts) == 4 and parts[2] == "optim" and bool(json.loads(manifest.read_text()).get("optimizer_dropped"))

    sha_a, sha_b = weights(a), weights(b)
    shared = sha_a.keys() & sha_b.keys()
    assert len(shared) >= min_weight_files and {k: sha_a[k] for k in shared} == {k: sha_b[k] for k in shared}
    # A file only one run holds is optimiser state the other deleted (a path that logs no steps keeps it all).
    assert all(dropped(b, k) for k in sha_a.keys() - shared) and all(dropped(a, k) for k in sha_b.keys() - shared)


class ListeningSockets:
    """Every listening TCP socket of this process and its descendants, sampled every
    ``interval_s`` while the context is open: {(pid, ip, port)}."""

    def __init__(self, interval_s: float = 0.05):
        import threading

        self.seen: set[tuple[int, str, int]] = set()
        self._interval_s = interval_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)

    def _sample(self) -> None:
        import psutil

        me = psutil.Process()
        for proc in [me, *me.children(recursive=True)]:
            try:
                for c in proc.net_connections("inet"):
                    if c.status == psutil.CONN_LISTEN:
                        self.seen.add((proc.pid, c.laddr.ip, c.laddr.port))
            except psutil.Error:  # a process that ended between the listing and the look
                pass

    def _poll(self) -> None:
        while not self._stop.wait(self._interval_s):
            self._sample()

    def __enter__(self) -> "ListeningSockets":
        self._sample()
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self._sample()
