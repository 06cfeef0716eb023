"""The torch generation engine: continuous batching over a paged, prefix-shared KV cache.

Scheduling. Prompts wait in order; a group (one prompt, its G samples) is admitted whole when the
live sequences plus G fit in ``EngineConfig.max_num_seqs``. Admitted prompts are prefilled together
in one forward; their full prompt blocks are shared by the G samples (stages/rollout/paged_kv.py).
Each decode step feeds only the live sequences; a finished sequence frees its blocks at once and
its slot is refilled by the next waiting group, so no step pays for finished rows.

Log-probs. ``behav_logp`` is the log-prob of each token under the distribution it was sampled
from: softmax(logits / T) truncated to top-k and top-p and renormalised (stages/rollout/sampling.py).
Without truncation (top_k = 0, top_p = 1) that is log softmax(logits / T), what the training loss
evaluates; with truncation the loss's untruncated log-prob is lower by the log of the kept mass.

Randomness. One seed is drawn from the caller's generator; every token's uniform is a hash of
(seed, prompt index, sample index, token index), so a sample does not depend on batching.

Threads and devices. The engine runs where the model's parameters are, in their dtype (the KV cache
follows them; :func:`engine_placement` resolves ``rollout.device`` and ``rollout.dtype``). Scheduling,
block tables and the uniforms stay on the host; each forward's inputs and index tensors are built
there and moved to the device in one copy each, and the sampled tokens come back once per step.
Sampling runs in float32 whatever the model's dtype. On the CPU the engine runs on the threads torch
is given (``torch.set_num_threads``, decided by the caller); it starts none of its own.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np
import torch

from stages.config import resolve_rollout_dtype
from stages.policy.model import DecoderStage
from stages.rollout.paged_kv import PagedKVCache
from stages.rollout.sampling import counter_uniforms, sample_from, truncated_logprobs

__all__ = ["SamplingParams", "EngineConfig", "RolloutBatch", "FINISH_STOP", "FINISH_LENGTH", "generate",
           "Rollout", "Runner", "assemble", "check_inputs", "draw_seed", "engine_placement", "new_cache",
           "prefill_logits", "run_engine"]

FINISH_STOP, FINISH_LENGTH = 0, 1
_SEED_RANGE = 2 ** 62  # the seed drawn from the caller's generator
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def engine_placement(device: str = "auto", dtype: str = "auto") -> tuple[torch.device, torch.dtype]:
    """The engine's device and dtype from their config spellings: ``device`` cpu, cuda, cuda:N or
    auto (cuda when torch sees a GPU, else cpu); ``dtype`` float32, bfloat16, float16 or auto
    (bfloat16 on CUDA, float32 on the CPU)."""
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        dev = torch.device(device)
    except RuntimeError:
        raise ValueError(f"rollout.device={device!r} is not a device: use auto, cpu, cuda or cuda:N") from None
    if dev.type not in ("cpu", "cuda"):
        raise ValueError(f"rollout.device={device!r}: the engine runs on cpu or cuda")
    if dev.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count == 0:
            raise ValueError(f"rollout.device={device!r} but torch {torch.__version__} sees no CUDA device "
                             f"(built for CUDA: {torch.version.cuda or 'no'}); use rollout.device=cpu or auto")
        if dev.index is not None and dev.index >= count:
            raise ValueError(f"rollout.device={device!r} but torch sees {count} CUDA device(s)")
    dtype = resolve_rollout_dtype(dtype, dev.type == "cuda")
    if dtype not in _DTYPES:  # the config's spellings (stages/config.py ROLLOUT_DTYPES)
        raise ValueError(f"rollout.dtype={dtype!r} is not one of auto, {', '.join(_DTYPES)}")
    return dev, _DTYPES[dtype]


@dataclass(frozen=True)
class SamplingParams:
    """How completions are sampled."""

    group_size: int
    """completions per prompt (G)"""
    max_new_tokens: int
    """generated tokens per completion at most, the stop token included"""
    temperature: float = 1.0
    """logits are divided by it before the softmax"""
    top_p: float = 1.0
    """nucleus mass kept (1 keeps every token)"""
    stop_ids: tuple[int, ...] = ()
    """tokens that end a completion (kept as its last token)"""
    pad_id: int = 0
    """fills tokens after a completion's end"""
    top_k: int = 0
    """most likely tokens kept before top-p (0 keeps every token)"""

    def __post_init__(self) -> None:
        if self.group_size < 1:
            raise ValueError(f"group_size={self.group_size} must be >= 1")
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens={self.max_new_tokens} must be >= 1")
        if not self.temperature > 0:
            raise ValueError(f"temperature={self.temperature} must be > 0")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p={self.top_p} must be in (0, 1]")
        if self.top_k < 0:
            raise ValueError(f"top_k={self.top_k} must be >= 0 (0 disables it)")


@dataclass(frozen=True)
class EngineConfig:
    """Memory layout and batch limits of the engine."""

    page_size: int = 16
    """tokens per KV block"""
    max_num_seqs: int = 256
    """live sequences one decode step holds at most; must be >= group_size (groups are admitted whole)"""

    def __post_init__(self) -> None:
        if self.page_size < 1:
            raise ValueError(f"page_size={self.page_size} must be >= 1")
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs={self.max_num_seqs} must be >= 1")


@dataclass
class RolloutBatch:
    """One row per completion, the G rows of a prompt contiguous."""

    prompt_ids: np.ndarray  # [P*G, prompt_width] int32, left-aligned, pad_id after prompt_len
    prompt_len: np.ndarray  # [P*G] int32
    tokens: np.ndarray  # [P*G, max_new_tokens] int32, pad_id after length
    length: np.ndarray  # [P*G] int32, generated tokens including the stop token
    behav_logp: np.ndarray  # [P*G, max_new_tokens] float32, 0 after length
    finish_reason: np.ndarray  # [P*G] int8, FINISH_STOP or FINISH_LENGTH
    kv_cache_bytes: int
    """peak bytes of KV blocks in use"""
    seconds: float
    kv_allocated_bytes: int = 0
    """bytes of every KV block allocated over the call (blocks freed and reused count again)"""
    kv_pool_bytes: int = 0
    """bytes of the block pool reserved up front"""
    decode_steps: int = 0
    """model forwards after prefill"""
    kv_view_bytes: int = 0
    """bytes of the decode views beside the pool, at their largest (stages/rollout/paged_kv.py)"""
    policy_version: int = -1
    """the version that generated the batch (set by stages/rollout/contract.py RolloutEngine)"""
    metrics: dict = field(default_factory=dict)
    """what the engine measured besides (speculative acceptance, restarts, ...)"""

    @property
    def tokens_per_s(self) -> float:
        return float(self.length.sum()) / max(self.seconds, 1e-9)


class Rollout:
    """Per-sequence state of one call: sequence ``row = prompt * G + sample``."""

    def __init__(self, prompts: list[list[int]], params: SamplingParams, seed: int):
        self.prompts, self.params, self.seed = prompts, params, seed
        P, G, N = len(prompts), params.group_size, params.max_new_tokens
        self.tokens = np.full((P * G, N), params.pad_id, dtype=np.int64)
        self.logp = np.zeros((P * G, N), dtype=np.float32)
        self.length = np.zeros(P * G, dtype=np.int64)
        self.stopped = np.zeros(P * G, dtype=bool)
        self._stop = frozenset(params.stop_ids)

    def uniforms(self, rows: np.ndarray, stream: int = 0, offset: np.ndarray | int = 0) -> torch.Tensor:
        """Uniforms for the next token (+ offset) of each row."""
        G = self.params.group_size
        return counter_uniforms(self.seed, rows // G, rows % G, self.length[rows] + offset, stream)

    def record(self, row: int, token: int, logp: float) -> bool:
        """Append one sampled token; True when the row is finished."""
        n = self.length[row]
        self.tokens[row, n], self.logp[row, n] = token, logp
        self.length[row] = n + 1
        self.stopped[row] = token in self._stop
        return self.stopped[row] or n + 1 == self.params.max_new_tokens

    def position(self, row: int) -> int:
        """Logical index of the row's newest token (prompt tokens first)."""
        return len(self.prompts[row // self.params.group_size]) + int(self.length[row]) - 1


class Runner(Protocol):
    """What the scheduler drives: prefill admitted groups, then decode the live rows."""

    def prefill(self, state: Rollout, groups: list[int]) -> list[int]:
        """Prefill ``groups``, sample each sample's first token; return the rows still live."""
        ...

    def step(self, state: Rollout, rows: list[int]) -> list[int]:
        """Add at least one token to every row; return the rows still live."""
        ...

    def release(self, row: int) -> None:
        ...


def _param(model: torch.nn.Module) -> torch.Tensor:
    return next(model.parameters())


def new_cache(model: DecoderStage, prompts: list[list[int]], params: SamplingParams, engine: EngineConfig,
              lookahead: int = 0) -> PagedKVCache:
    """A pool that never runs out, so admission waits only on ``max_num_seqs``.

    Live rows hold at most their own worst case each (max_num_seqs of them), and every group with a
    live row holds its shared prompt blocks (at most min(P, max_num_seqs) groups): the bound is the
    sum of the largest of each, capped by the whole rollout's worst case.
    """
    cfg, G, page = model.cfg, params.group_size, engine.page_size
    shared = sorted((len(p) // page for p in prompts), reverse=True)
    own = sorted((-(-(len(p) % page + params.max_new_tokens + lookahead) // page) for p in prompts), reverse=True)
    own_rows = [b for b in own for _ in range(G)]
    n = engine.max_num_seqs
    blocks = min(sum(shared[:n]) + sum(own_rows[:n]), sum(shared) + sum(own_rows))
    return PagedKVCache(cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim, page, blocks,
                        len(prompts) * G, dtype=_param(model).dtype, device=_param(model).device, group_size=G,
                        num_lanes=min(n, len(prompts) * G),
                        max_own_tokens=params.max_new_tokens + lookahead)


def prefill_logits(model: DecoderStage, cache: PagedKVCache, prompts: list[list[int]], groups: list[int],
                   G: int) -> torch.Tensor:
    """One forward over the admitted prompts (right-padded); returns last-position logits [len(groups), V]."""
    lens = [len(prompts[g]) for g in groups]
    L = max(lens)
    ids = torch.zeros((len(groups), L), dtype=torch.long)
    valid = torch.zeros((len(groups), L), dtype=torch.bool)
    src, dst = [], []
    for a, g in enumerate(groups):
        ids[a, : lens[a]] = torch.tensor(prompts[g])
        valid[a, : lens[a]] = True
        s, d = cache.add_group(list(range(g * G, g * G + G)), lens[a])
        src += [a * L + t for t in s]
        dst += d
    dev = _param(model).device
    cache.prepare_prefill(torch.tensor(src, dtype=torch.long), torch.tensor(dst, dtype=torch.long), valid)
    positions = torch.arange(L).expand(len(groups), L)
    logits = model(ids.to(dev), positions.to(dev), cache)
    return logits[torch.arange(len(groups), device=dev), torch.tensor(lens, device=dev) - 1]


class _PlainRunner:
    def __init__(self, model: DecoderStage, cache: PagedKVCache):
        self.model, self.cache = model, cache

    def _sample(self, state: Rollout, rows: list[int], logits: torch.Tensor) -> list[int]:
        p = state.params
        r = np.asarray(rows)
        logp = truncated_logprobs(logits, p.temperature, p.top_k, p.top_p)
        token = sample_from(logp, state.uniforms(r))
        tok_logp = logp.gather(-1, token[:, None]).squeeze(-1)
        live = []
        for row, t, lp in zip(rows, token.tolist(), tok_logp.tolist()):  # one copy each to the host
            if not state.record(row, t, lp):
                self.cache.append(row)
                live.append(row)
        return live

    def prefill(self, state: Rollout, groups: list[int]) -> list[int]:
        G = state.params.group_size
        logits = prefill_logits(self.model, self.cache, state.prompts, groups, G)
        rows = [g * G + s for g in groups for s in range(G)]
        return self._sample(state, rows, logits.repeat_interleave(G, dim=0))

    def step(self, state: Rollout, rows: list[int]) -> list[int]:
        dev = _param(self.model).device
        ids = torch.tensor([int(state.tokens[r, state.length[r] - 1]) for r in rows])[:, None]
        positions = torch.tensor([state.position(r) for r in rows])[:, None]
        self.cache.prepare_decode(rows, positions)  # host positions: the cache's bookkeeping reads them
        logits = self.model(ids.to(dev), positions.to(dev), self.cache)[:, -1]
        return self._sample(state, rows, logits)

    def release(self, row: int) -> None:
        self.cache.free(row)


def run_engine(runner: Runner, state: Rollout, max_num_seqs: int) -> int:
    """Continuous batching until every group is done; returns the number of decode steps."""
    G, P = state.params.group_size, len(state.prompts)
    next_group, live, steps = 0, [], 0
    while next_group < P or live:
        admit = []
        while next_group < P and len(live) + G * (len(admit) + 1) <= max_num_seqs:
            admit.append(next_group)
            next_group += 1
        if admit:
            started = runner.prefill(state, admit)
            admitted = {g * G + s for g in admit for s in range(G)}
            for row in sorted(admitted.difference(started)):
                runner.release(row)
            live += started
        if live:
            still = runner.step(state, live)
            for row in sorted(set(live).difference(still)):
                runner.release(row)
            live, steps = still, steps + 1
    return steps


def assemble(state: Rollout, cache: PagedKVCache, seconds: float, steps: int) -> RolloutBatch:
    prompts, params = state.prompts, state.params
    G = params.group_size
    width = max(len(p) for p in prompts)
    prompt_ids = np.full((len(prompts), width), params.pad_id, dtype=np.int32)
    for i, p in enumerate(prompts):
        prompt_ids[i, : len(p)] = p
    return RolloutBatch(
        prompt_ids=np.repeat(prompt_ids, G, axis=0),
        prompt_len=np.repeat(np.array([len(p) for p in prompts], dtype=np.int32), G),
        tokens=state.tokens.astype(np.int32),
        length=state.length.astype(np.int32),
        behav_logp=state.logp,
        finish_reason=np.where(state.stopped, FINISH_STOP, FINISH_LENGTH).astype(np.int8),
        kv_cache_bytes=cache.peak_blocks * cache.block_bytes,
        seconds=seconds,
        kv_allocated_bytes=cache.blocks_allocated * cache.block_bytes,
        kv_pool_bytes=cache.pool_bytes,
        decode_steps=steps,
        kv_view_bytes=cache.view_bytes,
    )


def draw_seed(generator: torch.Generator) -> int:
    """The one draw from the caller's generator; every uniform of the call derives from it."""
    return int(torch.randint(0, _SEED_RANGE, (1,), generator=generator))


def check_inputs(model: DecoderStage, prompts: list[list[int]], params: SamplingParams, engine: EngineConfig) -> None:
    if not (model.is_first and model.is_last):
        raise ValueError("generate needs the whole model (one stage holding every layer)")
    if not prompts or min(len(p) for p in prompts) < 1:
        raise ValueError("generate needs at least one prompt, each of at least one token")
    if engine.max_num_seqs < params.group_size:
        raise ValueError(f"max_num_seqs={engine.max_num_seqs} is below group_size={params.group_size}; "
                         "raise max_num_seqs, a group is admitted whole")


@torch.inference_mode()
def generate(model: DecoderStage, prompts: list[list[int]], params: SamplingParams,
             generator: torch.Generator, engine: EngineConfig | None = None) -> RolloutBatch:
    """Sample ``params.group_size`` completions for each tokenised prompt."""
    engine = engine or EngineConfig()
    check_inputs(model, prompts, params, engine)
    start = time.perf_counter()
    seed = draw_seed(generator)
    state = Rollout(prompts, params, seed)
    cache = new_cache(model, prompts, params, engine)
    steps = run_engine(_PlainRunner(model, cache), state, engine.max_num_seqs)
    return assemble(state, cache, time.perf_counter() - start, steps)
