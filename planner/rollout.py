"""Rollout phase: inference-engine memory, KV-cache concurrency, generation time, weight sync.

Decode is a roofline: each step reads the engine's weights and the live KV once from HBM and does
2 FLOPs per weight per token (Pope et al. 2022, "Efficiently Scaling Transformer Inference", Sec. 2),
plus two TP all-reduces per layer, which are latency-bound at decode batch sizes. Prefill is
compute-bound. The prompt prefix is prefilled once per group and shared by its G samples.
Speculative decoding: with draft length gamma and acceptance alpha a verification step yields
(1 - alpha^(gamma+1)) / (1 - alpha) tokens (Leviathan et al. 2023, Eq. 1).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from planner.config import PlanConfig
from planner.constants import BF16_BYTES, FP32_BYTES
from planner.memory import estimate_kv_cache_bytes, estimate_kv_cache_bytes_per_gpu
from planner.model import (
    ModelShape,
    estimate_forward_flops_per_token,
    estimate_kv_bytes_per_token,
    estimate_parameter_count,
)

__all__ = [
    "RolloutEstimate",
    "WeightSyncEstimate",
    "estimate_decode_step_s",
    "estimate_paged_kv_blocks",
    "estimate_paged_kv_bytes",
    "estimate_rollout",
    "estimate_weight_sync",
    "speculative_tokens_per_step",
]

_PREFILL_CHUNK_TOKENS = 8192  # chunked-prefill token budget per engine step (vLLM max_num_batched_tokens)
_PREFILL_ACT_BYTES_PER_TOKEN_H = 34  # one layer's live activations per token, in units of h (Korthikanti 2022)


@dataclass(frozen=True)
class RolloutEstimate:
    """Generation of one step's samples on ``rollout_gpus`` GPUs (engines of TP ``engine_tp``)."""

    rollout_gpus: int
    engine_tp: int
    num_engines: int
    groups_per_engine: int
    concurrent_groups: int
    """groups one engine decodes at once (KV budget), 0 when not even one group fits"""
    waves: int
    decode_steps: int
    decode_step_s: float
    prefill_s: float
    total_s: float
    weights_bytes_per_gpu: float
    kv_bytes_per_group_per_gpu: float
    kv_bytes_all_groups_per_gpu: float
    """KV if the engine held all its groups at once"""
    kv_bytes_per_gpu: float
    """KV at the chosen concurrency"""
    resident_bytes_per_gpu: float
    """training state left on the GPU during rollout (colocated)"""
    workspace_bytes_per_gpu: float
    memory_cap_bytes: float

    @property
    def memory_bytes_per_gpu(self) -> float:
        return self.weights_bytes_per_gpu + self.kv_bytes_per_gpu + self.resident_bytes_per_gpu + self.workspace_bytes_per_gpu

    @property
    def feasible(self) -> bool:
        return self.concurrent_groups >= 1


@dataclass(frozen=True)
class WeightSyncEstimate:
    """Publishing new policy weights to the inference engines."""

    bytes_total: float
    """bf16 weights of one model copy"""
    bytes_per_receiver: float
    transfer_s: float
    kv_s: float
    """KV handling of in-flight sequences (recompute / drain), 0 for keep or when nothing is in flight"""
    kv_tokens_invalidated: float
    kv_pages_invalidated: float
    mode: str

    @property
    def total_s(self) -> float:
        return self.transfer_s + self.kv_s


def estimate_paged_kv_blocks(prompt_lens: Sequence[int], completion_lens: Sequence[Sequence[int]],
                             page_size: int) -> int:
    """KV blocks the paged rollout engine allocates for groups with these prompt and completion lengths.

    Per group with prompt length p and completions of n_s tokens (the stop token included):
    ``p // page`` full prompt blocks shared by the G samples, plus per sample
    ``ceil((p % page + n_s - 1) / page)`` blocks: its copy of the partial prompt block and the KV of every
    generated token but the last, which is sampled and never fed back (stages/rollout/paged_kv.py).
    This counts every allocation over the rollout, i.e. the footprint were all groups live at once.
    """
    if len(prompt_lens) != len(completion_lens):
        raise ValueError(f"{len(prompt_lens)} prompt lengths but {len(completion_lens)} groups of completion lengths")
    blocks = 0
    for p, group in zip(prompt_lens, completion_lens):
        full, partial = divmod(p, page_size)
        blocks += full + sum(-(-(partial + n - 1) // page_size) for n in group)
    return blocks


def estimate_paged_kv_bytes(model: ModelShape, prompt_lens: Sequence[int], completion_lens: Sequence[Sequence[int]],
                            page_size: int, dtype_bytes: int = BF16_BYTES) -> int:
    """Blocks x block bytes; a block holds K and V of ``page_size`` tokens in every layer."""
    block_bytes = page_size * estimate_kv_bytes_per_token(model, dtype_bytes)
    return estimate_paged_kv_blocks(prompt_lens, completion_lens, page_size) * block_bytes


def speculative_tokens_per_step(draft_tokens: int, acceptance: float) -> float:
    """Expected tokens per verification step: (1 - a^(g+1)) / (1 - a); 1 without drafts."""
    if draft_tokens == 0:
        return 1.0
    return (1 - acceptance ** (draft_tokens + 1)) / (1 - acceptance)


def estimate_decode_step_s(cfg: PlanConfig, batch: int, context_len: float, *, tokens_per_seq: int = 1) -> float:
    """One decode step of ``batch`` sequences at ``context_len`` on one engine (roofline + TP latency)."""
    model, cluster, tp = cfg.model_shape, cfg.cluster, cfg.rollout.rollout_tensor_parallel_size
    flops = batch * tokens_per_seq * estimate_forward_flops_per_token(model, 0) / tp
    flops += batch * tokens_per_seq * 4 * model.num_hidden_layers * model.q_dim * context_len / tp
    weights = estimate_parameter_count(model) * BF16_BYTES / tp
    kv_total = batch * context_len * 2 * model.num_hidden_layers * model.kv_dim * cfg.rollout.kv_dtype_bytes
    kv = estimate_kv_cache_bytes_per_gpu(kv_total, model, tp)
    compute_s = flops / (cluster.peak_flops * cluster.mfu)
    memory_s = (weights + kv) / (cluster.hbm_bandwidth_bytes_per_s * cluster.hbm_efficiency)
    comm_s = 0.0
    if tp > 1:
        msg = batch * tokens_per_seq * model.hidden_size * BF16_BYTES
        per_collective = 2 * (tp - 1) / tp * msg / cluster.intra_node_bandwidth_bytes_per_s + cluster.collective_latency_s
        comm_s = 2 * model.num_hidden_layers * per_collective
    return max(compute_s, memory_s) + comm_s


def _prefill_s(cfg: PlanConfig, tokens: float) -> float:
    model, cluster, tp = cfg.model_shape, cfg.cluster, cfg.rollout.rollout_tensor_parallel_size
    flops = tokens * estimate_forward_flops_per_token(model, cfg.workload.prompt_len)
    return flops / tp / (cluster.peak_flops * cluster.mfu)


def estimate_rollout(cfg: PlanConfig, rollout_gpus: int, resident_bytes_per_gpu: float = 0.0) -> RolloutEstimate:
    """Time and memory of generating all ``prompts_per_step * G`` samples on ``rollout_gpus`` GPUs."""
    model, wl, ro = cfg.model_shape, cfg.workload, cfg.rollout
    tp = ro.rollout_tensor_parallel_size
    engines = max(1, rollout_gpus // tp)
    groups = math.ceil(wl.prompts_per_step / engines)
    weights = estimate_parameter_count(model) * BF16_BYTES / tp
    per_group_total = estimate_kv_cache_bytes(model, 1, wl.group_size, wl.prompt_len, wl.gen_len,
                                              ro.kv_dtype_bytes, ro.share_prefix, ro.page_size)
    per_group = estimate_kv_cache_bytes_per_gpu(per_group_total, model, tp)
    cap = cfg.cluster.memory_cap_bytes
    batch_guess = groups * wl.group_size
    workspace = (_PREFILL_CHUNK_TOKENS * _PREFILL_ACT_BYTES_PER_TOKEN_H * model.hidden_size / tp
                 + batch_guess * model.vocab_size * FP32_BYTES / tp)
    budget = cap - weights - resident_bytes_per_gpu - workspace
    concurrent = max(0, min(groups, int(budget // per_group))) if budget > 0 else 0
    if concurrent == 0:
        return RolloutEstimate(rollout_gpus, tp, engines, groups, 0, 0, 0, 0.0, 0.0, math.inf, weights, per_group,
                               per_group * groups, 0.0, resident_bytes_per_gpu, workspace, cap)
    steps, step_s, waves = _decode_schedule(cfg, groups, concurrent)
    prefill = _prefill_s(cfg, groups * wl.prompt_len)
    return RolloutEstimate(rollout_gpus, tp, engines, groups, concurrent, waves, steps, step_s, prefill,
                           prefill + steps * step_s, weights, per_group, per_group * groups,
                           per_group * concurrent, resident_bytes_per_gpu, workspace, cap)


def _decode_schedule(cfg: PlanConfig, groups: int, concurrent: int) -> tuple[int, float, int]:
    """(decode steps, seconds per step, waves) for static lockstep waves or continuous batching."""
    wl, ro = cfg.workload, cfg.rollout
    slots = concurrent * wl.group_size
    per_step = speculative_tokens_per_step(ro.speculative_draft_tokens, ro.speculative_acceptance)
    verify = ro.speculative_draft_tokens + 1
    if ro.batching == "static":
        waves = math.ceil(groups / concurrent)
        tokens_per_slot = wl.gen_len * waves  # a wave runs until its longest sample hits gen_len
        context = wl.prompt_len + wl.gen_len / 2
    else:
        waves = 1
        tokens_per_slot = max(wl.gen_len, math.ceil(groups * wl.group_size * wl.mean_generated / slots))
        context = wl.prompt_len + wl.mean_generated / 2
    steps = math.ceil(tokens_per_slot / per_step)
    step_s = estimate_decode_step_s(cfg, slots, context, tokens_per_seq=verify)
    if ro.speculative_draft_tokens:
        step_s += ro.speculative_draft_tokens * ro.draft_cost_ratio * estimate_decode_step_s(cfg, slots, context)
    return steps, step_s, waves


def estimate_weight_sync(cfg: PlanConfig, rollout: RolloutEstimate, *, in_flight: bool) -> WeightSyncEstimate:
    """Time to publish bf16 weights from the training layout to every inference engine.

    Decoupled: a pipelined broadcast is bound by the busier side: each receiving GPU takes its TP shard
    (2N / TP_rollout bytes), each training GPU sends engines * 2N / training GPUs, over the inter-node
    network. Colocated: each GPU regathers its rollout shard from the PP ranks holding it.
    ``in_flight`` sequences (asynchronous rollout) have KV computed by the old weights: ``recompute``
    re-prefills them, ``drain`` waits half a generation, ``keep`` continues on stale KV (cost 0, the tail
    of those sequences is off-policy). With PagedAttention invalidation is a page-table update (PagedAttention,
    Kwon et al. 2023): pages are freed, not moved, so the cost is the recompute, not the bookkeeping.
    """
    model, cluster, ro = cfg.model_shape, cfg.cluster, cfg.rollout
    total = estimate_parameter_count(model) * BF16_BYTES
    per_receiver = total / ro.rollout_tensor_parallel_size
    if ro.placement == "decoupled":
        per_sender = rollout.num_engines * total / cfg.training_gpus
        transfer = max(per_receiver, per_sender) / cluster.inter_node_bandwidth_bytes_per_s
    else:
        pp = cfg.train.pipeline_model_parallel_size
        local = per_receiver / pp if cfg.train.tensor_model_parallel_size == ro.rollout_tensor_parallel_size else 0.0
        transfer = (per_receiver - local) / cluster.inter_node_bandwidth_bytes_per_s
    transfer += cluster.collective_latency_s * 2 * model.num_hidden_layers
    wl = cfg.workload
    tokens = rollout.concurrent_groups * (wl.prompt_len + wl.group_size * wl.mean_generated / 2) if in_flight else 0.0
    pages = tokens / ro.page_size
    kv_s = 0.0
    if in_flight and ro.kv_on_weight_sync == "recompute":
        kv_s = _prefill_s(cfg, tokens)
    elif in_flight and ro.kv_on_weight_sync == "drain":
        kv_s = wl.mean_generated / 2 * rollout.decode_step_s
    return WeightSyncEstimate(total, per_receiver, transfer, kv_s, tokens, pages, ro.kv_on_weight_sync)
