"""Training phase: per-stage action durations, the simulated step, and memory per pipeline rank.

FLOPs per stage and microbatch: forward 2*P*T for matmul weights (Kaplan 2020; 6N for a full
forward+backward, Hoffmann 2022) plus causal attention; input-backward I = 2*P*T + 2x the attention;
weight-backward W = 2*P*T (Qi et al. 2023 split). Recompute adds the recomputed forward to I (full:
the whole layer; selective: core attention, Korthikanti 2022). Time = FLOPs / TP / (peak * MFU) plus
TP collectives (2 per layer per pass, ring cost 2(t-1)/t * bytes / NVLink bandwidth + latency) -
Megatron-style TP without communication overlap.

Rank placement follows Megatron's order (TP innermost, then DP, then PP), so a pipeline hop crosses
nodes when TP*DP spans a node.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from functools import lru_cache

from planner.config import ClusterConfig, PlanConfig, TrainConfig
from planner.constants import BF16_BYTES, CAUSAL_ATTENTION_FLOP_FACTOR
from planner.memory import (
    ACTIVATION_IMPLS,
    ActivationImpl,
    estimate_activation_bytes_per_microbatch,
    estimate_logits_buffer_bytes,
    estimate_optimizer_bytes,
    estimate_stage_parameters,
)
from planner.model import ModelShape, estimate_layer_parameter_count, estimate_parameter_count
from stages.layout import balanced_layer_split, stage_to_rank
from planner.simulator import ActionDurations, ScheduleSimulation, simulate_peak_stash_bytes, simulate_schedule

_ADAM_STEP_BYTES_PER_PARAM = 30  # HBM traffic of one Adam update per parameter, see estimate_train_step
_CHUNKED_HEAD_MATMULS = 4  # chunked loss: logits in the forward, again in the backward, then grad h and grad W

__all__ = [
    "StageLayout",
    "TrainingMemory",
    "TrainStepEstimate",
    "estimate_stage_layout",
    "estimate_head_layers",
    "estimate_layer_split",
    "activation_impl_of",
    "estimate_action_durations",
    "estimate_train_step",
    "estimate_training_memory",
    "reference_parameters",
    "estimate_schedule_in_flight",
    "estimate_stage_activation_bytes",
    "estimate_reference_pass_s",
    "pipeline_hop_crosses_node",
    "ring_collective_s",
]


@dataclass(frozen=True, slots=True)
class StageLayout:
    """Which layers and extras each virtual stage holds, and on which rank."""

    layers: tuple[int, ...]
    ranks: tuple[int, ...]
    num_ranks: int

    @property
    def last(self) -> int:
        return len(self.layers) - 1


@dataclass(frozen=True, slots=True)
class TrainingMemory:
    """Peak bytes on one GPU of one pipeline rank during the training step."""

    rank: int
    weights_bytes: float
    grads_bytes: float
    optimizer_bytes: float
    activation_bytes: float
    logits_bytes: float
    """transient bf16 logits + fp32 logit gradient of one microbatch (ranks holding the last stage)"""
    working_bytes: float
    """one layer re-materialised in backward (recompute) / its gradient buffers"""
    peak_in_flight: float
    reference_bytes: float = 0.0
    """the frozen reference on this rank, bf16 (the KL's reference pass runs on the training layout): its
    copy of the rank's stages, or the whole model with train.reference_parallel = data"""

    @property
    def total_bytes(self) -> float:
        return (self.weights_bytes + self.grads_bytes + self.optimizer_bytes + self.activation_bytes
                + self.logits_bytes + self.working_bytes + self.reference_bytes)

    @property
    def resident_bytes(self) -> float:
        """What stays between steps: weights, the frozen reference, gradients and optimiser state."""
        return self.weights_bytes + self.reference_bytes + self.grads_bytes + self.optimizer_bytes


@dataclass(frozen=True)
class TrainStepEstimate:
    """One GRPO training step: ``num_updates`` optimiser steps of the pipeline, DP sync, optimiser."""

    durations: ActionDurations
    simulation: ScheduleSimulation
    num_updates: int
    pipeline_s: float
    dp_sync_s: float
    optimizer_s: float
    model_flops: float
    """useful FLOPs of the step (6N-style, no recompute) for MFU"""
    simulated_microbatches: int
    """microbatches in ``simulation`` (fewer than the step's when extrapolated)"""

    @property
    def total_s(self) -> float:
        return self.pipeline_s + self.dp_sync_s + self.optimizer_s


def ring_collective_s(num_bytes: float, group: int, bandwidth: float, latency_s: float) -> float:
    """Ring all-reduce time: 2(g-1)/g * bytes / bandwidth + latency (Patarasuk & Yuan 2009)."""
    if group <= 1:
        return 0.0
    return 2 * (group - 1) / group * num_bytes / bandwidth + latency_s


def pipeline_hop_crosses_node(train: TrainConfig, gpus_per_node: int) -> bool:
    """True when some GPU pair of some pipeline hop lies on two nodes (TP innermost, then DP, then PP)."""
    stride = train.tensor_model_parallel_size * train.data_parallel_size
    for rank in range(train.pipeline_model_parallel_size - 1):
        for offset in range(stride):
            gpu = rank * stride + offset
            if gpu // gpus_per_node != (gpu + stride) // gpus_per_node:
                return True
    return False


def estimate_stage_layout(model: ModelShape, train: TrainConfig, seq_len: int) -> StageLayout:
    """Layer split over the p*v virtual stages (:func:`estimate_layer_split`) and the rank of each."""
    p, v = train.pipeline_model_parallel_size, train.virtual_pipeline_model_parallel_size
    return StageLayout(estimate_layer_split(model, train, seq_len), stage_to_rank(train.schedule, p, v), p)


def estimate_head_layers(model: ModelShape, seq_len: int, recompute: str = "none",
                         chunked_new_tokens: int | None = None) -> float:
    """The head's forward + backward FLOPs in decoder layers' (both per sequence of ``seq_len``
    tokens, from :func:`_stage_flops`): with full logits, per token, 2 V d / (2 x a layer's matmul
    weights + 2 q_dim s x CAUSAL_ATTENTION_FLOP_FACTOR). Not counted: the final norm, the
    log-softmax (a few FLOPs a logit against the matmul's 2 d) and the embedding's gather.

    ``chunked_new_tokens`` (the chunked loss, train.logprob_chunk_tokens; its rollout.max_new_tokens):
    the head projects only a sequence's completion tokens, 0 to this many, and recomputes their
    logits in the backward (stages/train/loss.py): 4 head matmuls a projected token instead of 3.
    The lengths are sampled, so they are counted at half of it: balancing that leaves the slowest
    stage at most half the full-length head's weight off, however long the completions run.
    SmolLM2-135M, s = 144: 56.6 M / 7.25 M = 7.8 layers; chunked, 48 new tokens: 7.8 x 4/3 x 24/144 = 1.7."""
    head = sum(_stage_flops(model, 0, 1, seq_len, True, recompute))
    if chunked_new_tokens is not None:
        head *= _CHUNKED_HEAD_MATMULS / 3 * min(chunked_new_tokens / 2, seq_len) / seq_len
    layer = sum(_stage_flops(model, 1, 1, seq_len, False, recompute))
    return head / layer


def estimate_layer_split(model: ModelShape, train: TrainConfig, seq_len: int) -> tuple[int, ...]:
    """Decoder layers per virtual stage: train.layer_split when it has p*v entries, else (auto, or
    a variant of the layout with another stage count) stages/layout ``balanced_layer_split`` with the
    head weighed by :func:`estimate_head_layers` (the runtime's GRPOConfig.layer_split, the same rule)."""
    num_stages = train.pipeline_model_parallel_size * train.virtual_pipeline_model_parallel_size
    if train.layer_split is not None and len(train.layer_split) == num_stages:
        return tuple(train.layer_split)
    return balanced_layer_split(model.num_hidden_layers, num_stages,
                                estimate_head_layers(model, seq_len, train.recompute, train.chunked_new_tokens))


def _stage_flops(model: ModelShape, layers: int, tokens: int, seq_len: int, has_head: bool,
                 recompute: str) -> tuple[float, float, float]:
    """(F, I, W) FLOPs of one microbatch on one stage, whole TP group."""
    matmul = 2.0 * (estimate_layer_parameter_count(model) - 2 * model.hidden_size) * tokens * layers
    attention = 4.0 * model.q_dim * seq_len * CAUSAL_ATTENTION_FLOP_FACTOR * tokens * layers
    head = 2.0 * model.vocab_size * model.hidden_size * tokens if has_head else 0.0
    forward = matmul + attention + head
    backward_input = matmul + 2 * attention + head
    backward_weight = matmul + head
    if recompute == "full":
        backward_input += matmul + attention
    elif recompute == "selective":
        backward_input += attention
    return forward, backward_input, backward_weight


def estimate_action_durations(model: ModelShape, cluster: ClusterConfig, train: TrainConfig, seq_len: int,
                              layout: StageLayout | None = None) -> ActionDurations:
    """Seconds per F / I / W / B of each virtual stage, and per pipeline transfer."""
    layout = layout or estimate_stage_layout(model, train, seq_len)
    tp, mbs = train.tensor_model_parallel_size, train.micro_batch_size
    tokens = mbs * seq_len
    rate = cluster.peak_flops * cluster.mfu
    act_bytes = tokens * model.hidden_size * BF16_BYTES
    collective = ring_collective_s(act_bytes, tp, cluster.intra_node_bandwidth_bytes_per_s,
                                   cluster.collective_latency_s)
    per_stage: dict[tuple[int, str], float] = {}
    for stage, layers in enumerate(layout.layers):
        f, i, w = _stage_flops(model, layers, tokens, seq_len, stage == layout.last, train.recompute)
        comm_passes = 2 * layers  # two TP collectives per layer per pass (attention out, MLP out)
        recompute_comm = comm_passes if train.recompute == "full" else 0
        per_stage[stage, "F"] = f / tp / rate + comm_passes * collective
        per_stage[stage, "I"] = i / tp / rate + (comm_passes + recompute_comm) * collective
        per_stage[stage, "W"] = w / tp / rate
        per_stage[stage, "B"] = per_stage[stage, "I"] + per_stage[stage, "W"]
    hop_bw = (cluster.inter_node_bandwidth_bytes_per_s if pipeline_hop_crosses_node(train, cluster.gpus_per_node)
              else cluster.intra_node_bandwidth_bytes_per_s)
    shard = tp if activation_impl_of(train).sequence_parallel else 1
    p2p = act_bytes / shard / hop_bw + cluster.collective_latency_s
    return ActionDurations(per_stage=per_stage, p2p_s=p2p)


def activation_impl_of(train: TrainConfig) -> ActivationImpl:
    """What a layer saves under ``train.activation_impl``, with the configured attention kernel. The eager
    decoder has no sequence parallelism; Megatron/TE follows ``train.sequence_parallel``."""
    impl = ACTIVATION_IMPLS[train.activation_impl]
    if train.activation_impl == "torch-eager":
        return dataclasses.replace(impl, attention=train.attention)
    return dataclasses.replace(impl, attention=train.attention, sequence_parallel=train.sequence_parallel)


def estimate_stage_activation_bytes(model: ModelShape, train: TrainConfig, seq_len: int, layout: StageLayout) -> dict[int, float]:
    return {
        stage: float(estimate_activation_bytes_per_microbatch(
            model, train.micro_batch_size, seq_len, layers, BF16_BYTES, train.recompute,
            is_first_stage=stage == 0, is_last_stage=stage == layout.last,
            tensor_parallel_size=train.tensor_model_parallel_size, impl=activation_impl_of(train),
            vocab_parallel=train.tensor_parallel_rules.vocab_parallel_embedding))
        for stage, layers in enumerate(layout.layers)
    }


@lru_cache(maxsize=4096)
def _order_simulation(schedule: str, p: int, m: int, v: int) -> ScheduleSimulation:
    """The schedule's order run with equal F, I, W times: its in-flight microbatches per stage."""
    if schedule == "gpipe" and m > 2 * p:
        # GPipe keeps every microbatch until the backward phase: m in flight on every stage, whatever m
        short = simulate_schedule(schedule, p, 2 * p, v, ActionDurations(), keep_events=False)
        return dataclasses.replace(short, num_microbatches=m, in_flight_profiles=tuple(((m,),) for _ in range(p)))
    return simulate_schedule(schedule, p, m, v, ActionDurations(), keep_events=False)


def estimate_schedule_in_flight(cfg: PlanConfig) -> ScheduleSimulation:
    """In-flight profile of the configured schedule (the order's, with uniform action times).

    Which microbatches are alive at once is a property of the action order; with m >= 2*p*v the
    profile no longer changes, so longer steps are simulated at that length (GPipe: m, in closed form).
    """
    train = cfg.train
    p, v = train.pipeline_model_parallel_size, train.virtual_pipeline_model_parallel_size
    m = cfg.num_microbatches
    if train.schedule != "gpipe":
        m = _simulated_microbatches(m, p, v, 1)
    return _order_simulation(train.schedule, p, m, v)


def reference_parameters(model: ModelShape, train: TrainConfig, stage_params: int) -> int:
    """Frozen-reference parameters a training rank holds beside its ``stage_params``: the same
    stages' copy, or the whole model with train.reference_parallel = data."""
    return estimate_parameter_count(model) if train.reference_parallel == "data" else stage_params


def estimate_training_memory(cfg: PlanConfig, simulation: ScheduleSimulation | None = None) -> tuple[TrainingMemory, ...]:
    """Memory stack of each pipeline rank; activation stash from the schedule's in-flight microbatches."""
    model, train, seq_len = cfg.model_shape, cfg.train, cfg.seq_len
    simulation = simulation or estimate_schedule_in_flight(cfg)
    layout = estimate_stage_layout(model, train, seq_len)
    tp, dp = train.tensor_model_parallel_size, train.data_parallel_size
    stash = simulate_peak_stash_bytes(simulation, estimate_stage_activation_bytes(model, train, seq_len, layout))
    tokens = train.micro_batch_size * seq_len
    one_layer = estimate_activation_bytes_per_microbatch(
        model, train.micro_batch_size, seq_len, 1, BF16_BYTES, "none",
        tensor_parallel_size=tp, impl=activation_impl_of(train))
    in_flight = simulation.peak_in_flight_per_rank
    vocab_tp = tp if train.tensor_parallel_rules.vocab_parallel_embedding else 1  # logits shard only with lm_head
    result = []
    for rank in range(layout.num_ranks):
        stages = [s for s, r in enumerate(layout.ranks) if r == rank]
        params = sum(estimate_stage_parameters(model, layout.layers[s], has_embedding=s == 0,
                                               has_head=s == layout.last, tensor_parallel_size=tp,
                                               single_stage=len(layout.layers) == 1,
                                               tp_rules=train.tensor_parallel_rules) for s in stages)
        holds_last = layout.last in stages
        result.append(TrainingMemory(
            rank=rank,
            weights_bytes=params * BF16_BYTES,
            grads_bytes=params * train.grad_dtype_bytes,
            optimizer_bytes=estimate_optimizer_bytes(params, dp, train.distributed_optimizer),
            activation_bytes=stash[rank],
            logits_bytes=estimate_logits_buffer_bytes(model, tokens, vocab_tp) if holds_last else 0.0,
            working_bytes=float(one_layer),
            peak_in_flight=in_flight[rank],
            reference_bytes=reference_parameters(model, train, params) * BF16_BYTES,
        ))
    return tuple(result)


def _simulated_microbatches(m: int, p: int, v: int, cap: int | None) -> int:
    """m, or a smaller multiple of p (>= 2*p*v) whose steady state is already reached."""
    if cap is None or m <= cap:
        return m
    floor = 2 * p * v
    reduced = max(cap, floor)
    reduced += (-reduced) % p
    return m if reduced >= m else reduced


@lru_cache(maxsize=16384)  # the search meets the same (schedule, p, m', v, durations) across placements
def _light_simulation(schedule: str, p: int, m: int, v: int, per_stage: tuple, p2p_s: float) -> ScheduleSimulation:
    durations = ActionDurations(per_stage=dict(per_stage), p2p_s=p2p_s)
    return simulate_schedule(schedule, p, m, v, durations, keep_events=False)


def estimate_train_step(cfg: PlanConfig, durations: ActionDurations | None = None, *,
                        max_simulated_microbatches: int | None = None) -> TrainStepEstimate:
    """Simulated training step: pipeline makespan per optimiser update, DP gradient sync, optimiser.

    With ``max_simulated_microbatches`` (the search), a step of m microbatches is simulated with m' < m
    and extended by (m - m') steady-state periods (m' + p simulated, less m', over p); in-flight peaks are
    unchanged once m' >= 2*p*v (tests check the extrapolation against full simulations).
    """
    model, train, cluster = cfg.model_shape, cfg.train, cfg.cluster
    layout = estimate_stage_layout(model, train, cfg.seq_len)
    durations = durations or estimate_action_durations(model, cluster, train, cfg.seq_len, layout)
    p, v, m = train.pipeline_model_parallel_size, train.virtual_pipeline_model_parallel_size, cfg.num_microbatches
    # GPipe keeps all m in flight, so its peaks need the whole step; it is cheap to simulate anyway
    cap = None if train.schedule == "gpipe" else max_simulated_microbatches
    m_sim = _simulated_microbatches(m, p, v, cap)
    period = 0.0
    if m_sim < m:
        key = (tuple(sorted(durations.per_stage.items())), durations.p2p_s)
        sim = _light_simulation(train.schedule, p, m_sim, v, *key)
        # The steady period is one more round of p microbatches, simulated: the busiest rank's F + B when
        # one rank is slowest, plus a hop when balanced neighbours run 1F1B in lock-step.
        period = (_light_simulation(train.schedule, p, m_sim + p, v, *key).makespan_s - sim.makespan_s) / p
    else:
        sim = simulate_schedule(train.schedule, p, m_sim, v, durations)
    makespan = sim.makespan_s + (m - m_sim) * period
    num_updates = cfg.workload.num_samples // cfg.global_batch_size
    tp, dp = train.tensor_model_parallel_size, train.data_parallel_size
    params_per_gpu = max(
        sum(estimate_stage_parameters(model, layout.layers[s], has_embedding=s == 0, has_head=s == layout.last,
                                      tensor_parallel_size=tp, tp_rules=train.tensor_parallel_rules)
            for s, r in enumerate(layout.ranks) if r == rank)
        for rank in range(p))
    dp_bw = (cluster.intra_node_bandwidth_bytes_per_s if tp * dp <= cluster.gpus_per_node
             else cluster.inter_node_bandwidth_bytes_per_s)
    # distributed optimiser: reduce-scatter grads + all-gather bf16 params = one all-reduce's traffic
    grad_bytes = params_per_gpu * (train.grad_dtype_bytes + BF16_BYTES) / 2
    dp_sync = ring_collective_s(grad_bytes, dp, dp_bw, cluster.collective_latency_s)
    # Adam reads and writes master, m, v (24 B), reads the fp32 grad (4 B), writes bf16 params (2 B): HBM-bound
    optimizer_bytes = params_per_gpu / (dp if train.distributed_optimizer else 1) * _ADAM_STEP_BYTES_PER_PARAM
    optimizer = optimizer_bytes / (cluster.hbm_bandwidth_bytes_per_s * cluster.hbm_efficiency)
    tokens = cfg.workload.num_samples * cfg.seq_len
    model_flops = tokens * sum(sum(_stage_flops(model, n, 1, cfg.seq_len, s == layout.last, "none"))
                               for s, n in enumerate(layout.layers))
    return TrainStepEstimate(durations, sim, num_updates, num_updates * makespan, num_updates * dp_sync,
                             num_updates * optimizer, model_flops, m_sim)


def estimate_reference_pass_s(cfg: PlanConfig, durations: ActionDurations) -> float:
    """Forward-only log-prob pass over all samples on the training layout (the reference; a proximal
    pass is the same pipelined pass).

    A forward-only pipeline takes (m + p - 1) forward slots of the slowest rank plus p-1 transfers
    (no backward, no stash: it can also fill 1F1B bubbles when run inside the training step). With
    train.reference_parallel = data every rank runs ceil(m / p) microbatches through the whole model
    (the sum of every stage's F) and one reduction gathers the log-probs (one transfer).
    """
    train = cfg.train
    p, v = train.pipeline_model_parallel_size, train.virtual_pipeline_model_parallel_size
    m = cfg.workload.num_samples // (train.data_parallel_size * train.micro_batch_size)
    if train.reference_parallel == "data":
        whole = sum(durations.duration(stage, "F") for stage in range(p * v))
        return -(-m // p) * whole + durations.p2p_s * (1 if p * train.data_parallel_size > 1 else 0)
    per_rank = [0.0] * p
    for stage, rank in enumerate(stage_to_rank(train.schedule, p, v)):
        per_rank[rank] += durations.duration(stage, "F")
    slowest = max(per_rank)
    return (m + p - 1) * slowest + (p * v - 1) * durations.p2p_s * (1 if p > 1 else 0)
