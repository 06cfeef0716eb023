"""Speculative decoding: a small draft proposes k tokens, the target verifies them in one forward.

Rule (Leviathan et al. 2023, Alg. 1; Chen et al. 2023, Alg. 2). With q_j the draft's and p_j the
target's sampling distribution (both truncated as in stages/rollout/sampling.py) at draft position
j, draft token d_j ~ q_j is accepted with probability min(1, p_j(d_j) / q_j(d_j)); at the first
rejection the token is drawn from norm(max(0, p_j - q_j)) and the step ends; when all k are accepted
a bonus token is drawn from p_{k+1}. Every emitted token is then distributed exactly as the target
would sample it, so ``behav_logp`` is the target's log p_j(token), as in the plain engine.

Per step and live sequence: k + 1 draft forwards of one token (the last writes d_k's KV so the
draft cache stays complete when all are accepted) and one target forward of k + 1 tokens. Both
models keep paged caches with the same block tables' shapes; rejected tokens' slots are released.
Uniforms are counter-based per (sequence, token index, stream) with separate streams for drafting,
accepting and the residual / bonus draw, so results do not depend on batching.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
import torch

from stages.policy.model import DecoderStage
from stages.rollout.engine import (
    EngineConfig,
    Rollout,
    RolloutBatch,
    SamplingParams,
    assemble,
    check_inputs,
    draw_seed,
    new_cache,
    prefill_logits,
    run_engine,
)
from stages.rollout.paged_kv import PagedKVCache
from stages.rollout.sampling import sample_from, truncated_logprobs

__all__ = ["draft_from_target", "generate_speculative", "SpeculativeStats"]

_DRAFT, _ACCEPT, _RESIDUAL = 1, 2, 3  # uniform streams


def draft_from_target(target: DecoderStage, num_layers: int) -> DecoderStage:
    """A draft sharing the target's embeddings, first ``num_layers`` layers, final norm and head
    (copies of them, on the target's device and in its dtype)."""
    if not 1 <= num_layers <= target.cfg.num_hidden_layers:
        raise ValueError(f"draft num_layers={num_layers} must be in [1, {target.cfg.num_hidden_layers}]")
    p = next(target.parameters())
    draft = DecoderStage(target.cfg, 0, num_layers, is_first=True, is_last=True).to(device=p.device, dtype=p.dtype)
    draft.load_state_dict({k: v for k, v in target.state_dict().items() if k in draft.state_dict()})
    return draft.eval()


@dataclass
class SpeculativeStats:
    """Drafted and accepted token counts of one call."""

    drafted: int = 0
    evaluated: int = 0
    """draft tokens the accept test ran on: the accepted ones and the first rejected one"""
    accepted: int = 0
    steps: int = 0
    """verification forwards"""
    row_steps: int = 0
    """sum over verification forwards of the rows they verified"""
    emitted: int = 0
    """tokens recorded by verification steps (the prefill's first tokens excluded)"""

    @property
    def acceptance(self) -> float:
        """Per-token acceptance rate alpha = E[min(1, p / q)] (Leviathan et al. 2023, Def. 3.1)."""
        return self.accepted / max(self.evaluated, 1)

    @property
    def tokens_per_verify(self) -> float:
        """Tokens a row gains per target forward; Leviathan et al. 2023 Eq. 1 predicts (1 - a^(k+1)) / (1 - a)."""
        return self.emitted / max(self.row_steps, 1)


class _SpeculativeRunner:
    def __init__(self, target: DecoderStage, draft: DecoderStage, cache: PagedKVCache, draft_cache: PagedKVCache,
                 k: int, always_accept: bool = False):
        self.target, self.draft, self.cache, self.draft_cache, self.k = target, draft, cache, draft_cache, k
        self.always_accept = always_accept  # a deliberately wrong rule, for tests that must reject it
        self.stats = SpeculativeStats()

    def _logp(self, state: Rollout, logits: torch.Tensor) -> torch.Tensor:
        p = state.params
        return truncated_logprobs(logits, p.temperature, p.top_k, p.top_p)

    def prefill(self, state: Rollout, groups: list[int]) -> list[int]:
        G = state.params.group_size
        logits = prefill_logits(self.target, self.cache, state.prompts, groups, G)
        prefill_logits(self.draft, self.draft_cache, state.prompts, groups, G)
        rows = [g * G + s for g in groups for s in range(G)]
        logp = self._logp(state, logits.repeat_interleave(G, dim=0))
        token = sample_from(logp, state.uniforms(np.asarray(rows), _RESIDUAL))
        tok_logp = logp.gather(-1, token[:, None]).squeeze(-1)
        live = []
        for row, t, lp in zip(rows, token.tolist(), tok_logp.tolist()):
            if not state.record(row, t, lp):
                self.cache.append(row)
                self.draft_cache.append(row)
                live.append(row)
        return live

    def step(self, state: Rollout, rows: list[int]) -> list[int]:
        k, r = self.k, np.asarray(rows)
        dev = next(self.target.parameters()).device
        last = torch.tensor([int(state.tokens[i, state.length[i] - 1]) for i in rows]).to(dev)
        pos0 = torch.tensor([state.position(i) for i in rows])  # on the host, as the caches read it
        # 1) draft: k + 1 one-token forwards; q[:, j] is the draft distribution of draft token j.
        fed, q = [last], []
        for j in range(k + 1):
            if j:
                for i in rows:
                    self.draft_cache.append(i)
            positions = (pos0 + j)[:, None]
            self.draft_cache.prepare_decode(rows, positions)
            logits = self.draft(fed[-1][:, None], positions.to(dev), self.draft_cache)[:, -1]
            if j < k:
                q.append(self._logp(state, logits))
                fed.append(sample_from(q[-1], state.uniforms(r, _DRAFT, offset=j)))
        drafts = torch.stack(fed[1:], dim=1)  # (B, k)
        # 2) verify: one target forward over [last, d_1 .. d_k].
        for i in rows:
            self.cache.append(i, k)
        positions = pos0[:, None] + torch.arange(k + 1)
        self.cache.prepare_decode(rows, positions)
        p = self._logp(state, self.target(torch.cat([last[:, None], drafts], 1), positions.to(dev),
                                          self.cache))  # (B, k+1, V)
        q = torch.stack(q, dim=1)  # (B, k, V)
        # 3) accept d_j while u_j * q_j(d_j) < p_j(d_j); the first rejection ends the run.
        p_d = p[:, :k].gather(-1, drafts[..., None]).squeeze(-1).double().exp()
        q_d = q.gather(-1, drafts[..., None]).squeeze(-1).double().exp()
        u = torch.stack([state.uniforms(r, _ACCEPT, offset=j) for j in range(k)], dim=1).to(dev)
        ok = torch.ones_like(p_d, dtype=torch.bool) if self.always_accept else u * q_d < p_d
        accepted = ok.long().cumprod(dim=1).sum(dim=1)  # (B,) leading accepts
        # 4) one more token: residual norm(max(0, p_j - q_j)) at the rejection, else the bonus from p_{k+1}.
        idx, batch = accepted.clamp(max=k), torch.arange(len(rows), device=dev)
        p_at = p[batch, idx].double().exp()
        q_at = torch.cat([q, torch.full_like(q[:, :1], float("-inf"))], 1)[batch, idx]
        resid = (p_at - q_at.double().exp()).clamp(min=0.0)
        # A residual of zero mass (p == q up to rounding) only arises with probability ~0; fall back to p.
        resid = torch.where(resid.sum(-1, keepdim=True) > 0, resid, p_at)
        extra = sample_from(resid.log(), state.uniforms(r, _RESIDUAL, offset=accepted.cpu().numpy()))
        # Row b emits drafts[b, :m] and then extra[b], at positions 0..m: their tokens and target
        # log-probs come to the host in one copy each.
        emit = torch.cat([drafts, drafts[:, :1]], 1)
        emit[batch, accepted] = extra
        emit_logp = p.gather(-1, emit[..., None]).squeeze(-1).tolist()
        emit, num_accepted = emit.tolist(), accepted.tolist()
        self.stats.steps += 1
        self.stats.row_steps += len(rows)
        live = []
        for b, row in enumerate(rows):
            m = num_accepted[b]
            self.stats.drafted += k
            self.stats.accepted += m
            self.stats.evaluated += min(m + 1, k)
            done = False
            for t, lp in zip(emit[b][: m + 1], emit_logp[b]):
                done = state.record(row, t, lp)
                self.stats.emitted += 1
                if done:
                    break
            if not done:
                n = len(state.prompts[row // state.params.group_size]) + int(state.length[row])
                _resize(self.cache, row, n)
                _resize(self.draft_cache, row, n)
                live.append(row)
        return live

    def release(self, row: int) -> None:
        self.cache.free(row)
        self.draft_cache.free(row)


def _resize(cache: PagedKVCache, row: int, length: int) -> None:
    """Reserve or release slots so that ``row`` holds ``length`` (the newest token's slot unwritten)."""
    if length < cache.lengths[row]:
        cache.truncate(row, length)
    elif length > cache.lengths[row]:
        cache.append(row, length - cache.lengths[row])


@torch.inference_mode()
def generate_speculative(target: DecoderStage, draft: DecoderStage, prompts: list[list[int]],
                         params: SamplingParams, generator: torch.Generator, num_draft_tokens: int = 4,
                         engine: EngineConfig | None = None,
                         _always_accept: bool = False) -> tuple[RolloutBatch, SpeculativeStats]:
    """``generate`` with ``num_draft_tokens`` draft proposals per target forward; same outputs' distribution."""
    engine = engine or EngineConfig()
    check_inputs(target, prompts, params, engine)
    if num_draft_tokens < 1:
        raise ValueError(f"num_draft_tokens={num_draft_tokens} must be >= 1")
    if draft.cfg.vocab_size != target.cfg.vocab_size:
        raise ValueError(f"draft vocab_size={draft.cfg.vocab_size} differs from the target's {target.cfg.vocab_size}")
    start = time.perf_counter()
    seed = draw_seed(generator)
    state = Rollout(prompts, params, seed)
    cache = new_cache(target, prompts, params, engine, lookahead=num_draft_tokens + 1)
    draft_cache = new_cache(draft, prompts, params, engine, lookahead=num_draft_tokens + 1)
    runner = _SpeculativeRunner(target, draft, cache, draft_cache, num_draft_tokens, _always_accept)
    steps = run_engine(runner, state, engine.max_num_seqs)
    return assemble(state, cache, time.perf_counter() - start, steps), runner.stats
