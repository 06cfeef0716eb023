"""vLLM behind the rollout engine contract, in a process of its own.

Run by the vLLM environment's Python (``.venv-vllm``: vLLM pins its own transformers and fastapi,
which the project's environment does not satisfy), started by :class:`stages.rollout.vllm_engine.VLLMEngine`
with one end of a socket pair as its only channel: no port, no file, nobody else can reach it. This
file imports nothing of the project, only the standard library, torch, safetensors and vLLM.

Requests (dicts over ``multiprocessing.connection``; every reply is a dict, ``{"error": "..."}``
when the request failed, and the process goes on, except after a failed ``generate``: vLLM's engine
may still hold that call's requests, and a later call would run them too, so the process answers
and exits, and the client starts a fresh one for the next call):

- ``start``: build ``vllm.LLM`` on a policy folder (token ids in and out: no tokenizer is loaded),
  once, first.
- ``load_folder``: the safetensors shards of a policy folder, through the worker's
  ``reload_weights`` (vLLM's in-place reload: the checkpoint loading path, then each layer's
  processing after loading), then the prefix cache is dropped: cached blocks of the old weights
  must not be reused.
- ``load_bytes``: the same from a safetensors buffer sent over the channel (in-memory weight sync).
- ``generate``: token-id prompts, n samples each, a seed per prompt (vLLM seeds a prompt's i-th
  sample with seed + i); answers the completions' ids, the sampled tokens' log-probs of the processed
  distribution (temperature, top-k, top-p applied: ``logprobs_mode=processed_logprobs``) and
  finish reasons.
- ``ping``, ``close``.

The process exits when its parent does (a thread watches the parent's pid) or when the channel
closes.
"""

from __future__ import annotations

import os
import sys
import threading
import time
import traceback
from multiprocessing.connection import Connection

# This file's folder (stages/rollout) comes first on the import path of a script run by path; its
# modules must not shadow the environment's packages.
sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != os.path.dirname(os.path.abspath(__file__))]


def _exit_with_parent(parent: int) -> None:
    # A thread, not PR_SET_PDEATHSIG: that fires when the spawning *thread* ends (a worker's task
    # thread), not the process.
    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(0.5)
        os._exit(1)

    threading.Thread(target=watch, name="exit-with-parent", daemon=True).start()


class _Server:
    def __init__(self) -> None:
        self.llm = None

    def start(self, model: str, dtype: str, max_model_len: int, max_num_seqs: int, kv_cache_bytes: int,
              compile: bool = False, max_num_batched_tokens: int = 0) -> dict:
        from vllm import LLM
        from vllm.config import SchedulerConfig

        t0 = time.perf_counter()
        # No chunked prefill: a prompt split over two scheduler steps makes vLLM rewind its seeded
        # generator (Generator.set_offset), which a CPU generator refuses; whole prompts only, so the
        # budget holds at least the longest sequence and one token per live sequence.
        budget = max(max_num_batched_tokens or SchedulerConfig.DEFAULT_MAX_NUM_BATCHED_TOKENS, max_model_len,
                     max_num_seqs)
        self.llm = LLM(model=model, skip_tokenizer_init=True, dtype=dtype, seed=0, max_model_len=max_model_len,
                       enable_chunked_prefill=False, max_num_batched_tokens=budget,
                       max_num_seqs=max_num_seqs, kv_cache_memory_bytes=kv_cache_bytes, enable_prefix_caching=True,
                       logprobs_mode="processed_logprobs", enforce_eager=True,
                       **({} if compile else {"compilation_config": {"mode": 0}}))
        import vllm

        return {"seconds": time.perf_counter() - t0, "vllm_version": vllm.__version__}

    def _load(self, weights) -> float:
        # The worker's reload_weights: the checkpoint path (the model's load_weights) for every
        # layer, then each layer's processing after loading again (the CPU backend repacks its
        # linear weights for its kernels, leaving the checkpoint-format parameters empty).
        t0 = time.perf_counter()
        self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": weights, "is_checkpoint_format": True})
        self.llm.reset_prefix_cache()
        return time.perf_counter() - t0

    def load_folder(self, files: list[str]) -> dict:
        from safetensors import safe_open

        def weights():
            for path in files:
                with safe_open(path, framework="pt") as f:
                    for name in f.keys():
                        yield name, f.get_tensor(name)

        return {"seconds": self._load(weights())}

    def load_bytes(self, blob: bytes) -> dict:
        from safetensors.torch import load

        tensors = load(blob)
        return {"seconds": self._load(iter(tensors.items()))}

    def generate(self, prompts: list[list[int]], seeds: list[int], n: int, max_tokens: int, temperature: float,
                 top_p: float, top_k: int, stop_token_ids: list[int]) -> dict:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        t0 = time.perf_counter()
        params = [SamplingParams(n=n, max_tokens=max_tokens, temperature=temperature, top_p=top_p,
                                 top_k=top_k if top_k > 0 else -1, stop_token_ids=stop_token_ids, ignore_eos=True,
                                 logprobs=0, seed=seed, detokenize=False) for seed in seeds]
        outputs = self.llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
        ids, logps, finish = [], [], []
        for out in outputs:  # in prompt order; each prompt's n samples in sample order
            for c in sorted(out.outputs, key=lambda c: c.index):
                ids.append(list(c.token_ids))
                logps.append([step[t].logprob for step, t in zip(c.logprobs, c.token_ids)])
                finish.append(c.finish_reason)
        return {"ids": ids, "logprobs": logps, "finish": finish, "seconds": time.perf_counter() - t0}


def main(fd: int, parent: int) -> None:
    _exit_with_parent(parent)
    conn = Connection(fd)
    server = _Server()
    while True:
        try:
            request = conn.recv()
        except (EOFError, OSError):
            return
        op = request.pop("op")
        if op == "close":
            conn.send({})
            return
        try:
            if op == "ping":
                reply = {"pid": os.getpid()}
            elif op == "load_bytes":
                reply = server.load_bytes(conn.recv_bytes())
            elif op in ("start", "load_folder", "generate"):
                if op != "start" and server.llm is None:
                    raise RuntimeError(f"{op} before start")
                reply = getattr(server, op)(**request)
            else:
                raise ValueError(f"unknown request {op!r}")
        except Exception as exc:  # the request failed; the process stays, unless a generate broke
            reply = {"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc(limit=8)}
            if op == "generate":
                conn.send(reply)
                return
        conn.send(reply)


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]))
