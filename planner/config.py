"""Plan configuration: a run config (configs/*.yaml, the runtime's own schema) plus its ``plan:`` section.

``grpoflow plan CONFIG`` reads the same YAML ``grpoflow run`` reads: the model from ``model`` (or
``model.path``'s config.json), the workload from ``task`` and ``rollout``, the layout from ``train``.
Everything only the planner needs sits in one ``plan:`` section the run ignores::

    plan:
      activation_impl: torch-eager   # or megatron-te
      tp_rules: runtime              # or megatron
      cluster:  {...}                # ClusterConfig
      train:    {...}                # recompute, distributed_optimizer, sequence_parallel, attention, grad_dtype_bytes
      workload: {...}                # prompt_len, mean_gen_len
      rollout:  {...}                # RolloutConfig (placement, engines, staleness, ...)
      search:   {...}                # SearchConfig

Every field is documented once, in the docstring under it. Bad input raises :class:`PlanConfigError`
with one line naming the key and the fix; the run's own checks (stages/config.py) run first.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from planner.constants import GIB
from planner.memory import ActivationImplName
from planner.model import ModelShape
from planner.validate import plan_layout_error
from stages.layout import TP_RULES, ScheduleName, TensorParallelRules
from stages.train.plan import microbatch_layout

__all__ = [
    "PlanConfigError",
    "ClusterConfig",
    "TrainConfig",
    "WorkloadConfig",
    "RolloutConfig",
    "SearchConfig",
    "PlanConfig",
]

Recompute = Literal["none", "selective", "full"]
Placement = Literal["colocated", "decoupled"]


class PlanConfigError(ValueError):
    """A plan config that cannot be planned; the message names the key and the fix."""


@dataclass(frozen=True, kw_only=True, slots=True)
class ClusterConfig:
    device: Literal["gpu", "cpu"] = "gpu"
    """What a "GPU" of this plan is: gpu (the defaults below: H100 SXM), or cpu (a CPU run's ranks on
    one host, its fields measured there: planner/host.py; a run config with train.device cpu and no
    plan.cluster section gets it)."""
    num_gpus: int = 64
    """All GPUs of the job (training plus rollout); in a run config, unset means the run's pp x dp x tp ranks."""
    gpus_per_node: int = 8
    """GPUs sharing the intra-node (NVLink) fabric."""
    gpu_memory_gib: float | None = 80.0
    """Device memory per GPU in GiB; ignored when gpu_memory_bytes is set."""
    gpu_memory_bytes: int | None = None
    """Device memory per GPU in bytes (overrides gpu_memory_gib)."""
    usable_memory_fraction: float = 0.9
    """Share of device memory a plan may fill; the rest is CUDA context, NCCL buffers, fragmentation."""
    peak_flops: float = 989e12
    """Dense bf16 FLOP/s per GPU (H100 SXM: 989 TFLOP/s)."""
    mfu: float = 0.45
    """Achieved share of peak_flops for matmul-bound work (training, prefill)."""
    hbm_bandwidth_bytes_per_s: float = 3.35e12
    """HBM bandwidth per GPU (H100 SXM: 3.35 TB/s)."""
    hbm_efficiency: float = 0.8
    """Achieved share of HBM bandwidth in memory-bound decode."""
    intra_node_bandwidth_bytes_per_s: float = 450e9
    """Per-GPU, per-direction NVLink bandwidth (H100 NVLink4: 450 GB/s)."""
    inter_node_bandwidth_bytes_per_s: float = 50e9
    """Per-GPU, per-direction network bandwidth (one 400 Gb/s NDR NIC per GPU: 50 GB/s)."""
    collective_latency_s: float = 10e-6
    """Fixed cost of one small collective or p2p message (NCCL over NVLink, order 10 us)."""
    host_bandwidth_bytes_per_s: float = 25e9
    """Achieved GPU<->host copy bandwidth (PCIe Gen5 x16), used to offload optimiser state."""

    @property
    def memory_bytes(self) -> int:
        """Device memory per GPU in bytes."""
        if self.gpu_memory_bytes is not None:
            return int(self.gpu_memory_bytes)
        return int(float(self.gpu_memory_gib or 0.0) * GIB)

    @property
    def memory_cap_bytes(self) -> float:
        """What a plan may use per GPU: memory_bytes * usable_memory_fraction."""
        return self.memory_bytes * self.usable_memory_fraction

    def __post_init__(self) -> None:
        _require(self.num_gpus >= 1, "plan.cluster.num_gpus", "must be >= 1")
        _require(self.gpus_per_node >= 1, "plan.cluster.gpus_per_node", "must be >= 1")
        _require(self.memory_bytes > 0, "plan.cluster.gpu_memory_gib", "set gpu_memory_gib or gpu_memory_bytes > 0")
        for key in ("usable_memory_fraction", "mfu", "hbm_efficiency"):
            _require(0 < getattr(self, key) <= 1, f"plan.cluster.{key}", "must be in (0, 1]")
        for key in ("peak_flops", "hbm_bandwidth_bytes_per_s", "intra_node_bandwidth_bytes_per_s",
                    "inter_node_bandwidth_bytes_per_s", "host_bandwidth_bytes_per_s"):
            _require(getattr(self, key) > 0, f"plan.cluster.{key}", "must be positive")


@dataclass(frozen=True, kw_only=True, slots=True)
class TrainConfig:
    tensor_model_parallel_size: int = 4
    """TP: ranks sharing each layer's matmuls (Megatron column/row parallel); stays inside a node."""
    pipeline_model_parallel_size: int = 8
    """PP: pipeline ranks."""
    data_parallel_size: int = 2
    """DP: model replicas; TP * PP * DP must equal the training GPUs."""
    virtual_pipeline_model_parallel_size: int = 1
    """v: model chunks per pipeline rank (interleaved-1f1b: >= 2; zbv / dualpipev: exactly 2)."""
    micro_batch_size: int = 1
    """Sequences per microbatch (padded to prompt_len + gen_len; one optimiser update a step, as the runtime)."""
    layer_split: tuple[int, ...] | None = None
    """Decoder layers per virtual stage (the run's train.layer_split); None: auto, the split balancing the
    stages' FLOPs with the head on the last (planner/training.py ``estimate_layer_split``). A layout with
    another number of stages (schedule variants, the search) uses auto."""
    chunked_new_tokens: int | None = None
    """Set (the loader: the run's rollout.max_new_tokens when its train.logprob_chunk_tokens is set): auto's
    layer split weighs the head as the chunked loss runs it, over the completion tokens only
    (planner/training.py ``estimate_head_layers``); unset: full logits. The stage times keep full logits."""
    schedule: ScheduleName = "1f1b"
    """Pipeline schedule: gpipe, 1f1b, interleaved-1f1b, zb-h1, zbv, dualpipev."""
    recompute: Recompute = "none"
    """Activation recomputation: none (the runtime), selective (core attention; Korthikanti 2022), full (every layer)."""
    distributed_optimizer: bool = False
    """Shard fp32 master weights and Adam moments over DP (Megatron distributed optimiser / ZeRO-1); the runtime
    keeps a whole optimiser on every DP rank."""
    sequence_parallel: bool = True
    """Shard norm/dropout activations over TP along the sequence (Korthikanti 2022, Sec. 4.2.2)."""
    attention: Literal["flash", "flash-masked", "eager"] = "flash"
    """flash keeps no s x s scores for backward; flash-masked also keeps an explicit (b, 1, s, s) mask (packed
    documents); eager keeps the softmax output."""
    reference_parallel: Literal["pipeline", "data"] = "pipeline"
    """The frozen reference (the run's train.reference_parallel): pipeline, each rank holds its stages' copy
    and the pass runs through the pipeline; data, each rank holds the whole model and runs its share of the
    microbatches (TP 1 only)."""
    grad_dtype_bytes: int = 4
    """Bytes per gradient element (Megatron accumulates main grads in fp32)."""
    clip_eps_low: float = 0.2
    """PPO/GRPO clip: ratios below 1 - clip_eps_low stop contributing when A < 0."""
    clip_eps_high: float = 0.28
    """Clip-higher upper bound (DAPO, Yu et al. 2025): ratios above 1 + clip_eps_high stop when A > 0."""
    activation_impl: ActivationImplName = "torch-eager"
    """What a layer saves for backward (planner/memory.py): torch-eager is this runtime's eager PyTorch decoder
    (4 F-wide SwiGLU tensors, eager RMSNorm and rotary, K/V repeated, no sequence parallelism); megatron-te is
    Megatron-LM with Transformer Engine (fused SwiGLU: 3 F-wide tensors; fused norm and rotary)."""
    tp_rules: Literal["runtime", "megatron"] = "runtime"
    """Tensor-parallel split (stages/layout/tensor_parallel.py): runtime needs TP to divide the KV heads and
    replicates embedding and lm_head; megatron replicates KV heads when TP > kv heads and shards the vocabulary."""

    @property
    def tensor_parallel_rules(self) -> TensorParallelRules:
        return TP_RULES[self.tp_rules]

    @property
    def training_gpus(self) -> int:
        return self.tensor_model_parallel_size * self.pipeline_model_parallel_size * self.data_parallel_size

    def __post_init__(self) -> None:
        for key in ("tensor_model_parallel_size", "pipeline_model_parallel_size", "data_parallel_size",
                    "virtual_pipeline_model_parallel_size", "micro_batch_size"):
            _require(getattr(self, key) >= 1, f"train.{key}", "must be >= 1")
        _require(self.grad_dtype_bytes in (2, 4), "plan.train.grad_dtype_bytes", "use 2 (bf16) or 4 (fp32)")
        _require(self.layer_split is None or all(isinstance(n, int) and n >= 1 for n in self.layer_split),
                 "train.layer_split", "give every stage a whole number of decoder layers >= 1 (or auto)")
        _require(self.chunked_new_tokens is None or self.chunked_new_tokens >= 1, "plan.train.chunked_new_tokens",
                 "must be >= 1 or unset")
        _require(self.reference_parallel in ("pipeline", "data"), "train.reference_parallel", "use pipeline or data")
        _require(self.reference_parallel == "pipeline" or self.tensor_model_parallel_size == 1,
                 "train.reference_parallel", "data holds the whole reference on every rank: needs TP 1")
        _require(0 < self.clip_eps_low < 1, "train.clip_eps_low", "must be in (0, 1)")
        _require(self.clip_eps_high > 0, "train.clip_eps_high", "must be positive")


@dataclass(frozen=True, kw_only=True, slots=True)
class WorkloadConfig:
    prompts_per_step: int = 64
    """Prompts sampled per GRPO step."""
    group_size: int = 8
    """G: completions per prompt; advantages are normalised inside each group."""
    prompt_len: int = 1024
    """Prompt tokens (training sequences are padded to prompt_len + gen_len)."""
    gen_len: int = 4096
    """Maximum generated tokens per completion."""
    mean_gen_len: int | None = None
    """Mean generated tokens; default gen_len (every completion runs to the cap, the worst case)."""

    @property
    def num_samples(self) -> int:
        return self.prompts_per_step * self.group_size

    @property
    def mean_generated(self) -> int:
        return self.gen_len if self.mean_gen_len is None else self.mean_gen_len

    def __post_init__(self) -> None:
        _require(self.prompts_per_step >= 1, "plan.workload.prompts_per_step", "must be >= 1")
        _require(self.group_size >= 2, "plan.workload.group_size", "GRPO needs G >= 2 to normalise inside a group")
        _require(self.prompt_len >= 1, "plan.workload.prompt_len", "must be >= 1")
        _require(self.gen_len >= 1, "plan.workload.gen_len", "must be >= 1")
        _require(self.mean_gen_len is None or 1 <= self.mean_gen_len <= self.gen_len,
                 "plan.workload.mean_gen_len", f"must be between 1 and gen_len ({self.gen_len})")


@dataclass(frozen=True, kw_only=True, slots=True)
class RolloutConfig:
    placement: Placement = "colocated"
    """colocated: rollout and training take turns on all GPUs; decoupled: rollout_gpus run only rollout."""
    rollout_gpus: int | None = None
    """GPUs dedicated to rollout when decoupled (training gets the rest); unset when colocated."""
    rollout_tensor_parallel_size: int = 1
    """TP of each inference engine; engines = rollout GPUs / this (the runtime's own engines use 1)."""
    staleness: int = 0
    """k: policy versions a rollout may lag the trainer (0 = synchronous on-policy)."""
    kv_dtype_bytes: int = 2
    """Bytes per KV-cache element (2 = bf16, 1 = fp8 KV)."""
    page_size: int = 16
    """Tokens per KV page (PagedAttention block; vLLM's default 16)."""
    share_prefix: bool = True
    """The G samples of a prompt share one prefix KV (how the runtime's engine allocates)."""
    batching: Literal["static", "continuous"] = "static"
    """static: a wave of groups decodes in lockstep to gen_len; continuous: finished slots refill at once."""
    speculative_draft_tokens: int = 0
    """gamma: draft tokens proposed per verification step (0 = no speculative decoding)."""
    speculative_acceptance: float = 0.7
    """alpha: chance a draft token is accepted (Leviathan et al. 2023)."""
    draft_cost_ratio: float = 0.05
    """Cost of one draft-model step relative to one target-model decode step."""
    kv_on_weight_sync: Literal["recompute", "keep", "drain"] = "recompute"
    """In-flight sequences at a weight update: recompute their KV, keep stale KV, or drain first."""
    offload_optimizer: bool = True
    """Colocated: move optimiser state to host during rollout to make room for the KV cache."""
    logratio_std_per_step: float = 0.05
    """sigma_step: std of a token's log(pi_new / pi_old) after one optimiser step (2*KL ~ 2.5e-3)."""
    logratio_std_mismatch: float = 0.02
    """sigma_0: std of log(pi_train / pi_rollout) from engine numerics at staleness 0."""
    drift_hot_token_share: float = 0.2
    """Share of high-entropy tokens whose log-ratio drifts faster (heavy tail of the drift model)."""
    drift_hot_std_multiplier: float = 4.0
    """How many times faster the hot tokens' log-ratio std grows."""

    def __post_init__(self) -> None:
        _require(self.rollout_gpus is None or self.rollout_gpus >= 1, "plan.rollout.rollout_gpus", "must be >= 1")
        _require(self.rollout_tensor_parallel_size >= 1, "plan.rollout.rollout_tensor_parallel_size", "must be >= 1")
        _require(self.staleness >= 0, "plan.rollout.staleness", "must be >= 0")
        _require(self.kv_dtype_bytes in (1, 2, 4), "plan.rollout.kv_dtype_bytes", "use 1, 2 or 4")
        _require(self.page_size >= 1, "plan.rollout.page_size", "must be >= 1")
        _require(self.speculative_draft_tokens >= 0, "plan.rollout.speculative_draft_tokens", "must be >= 0")
        _require(0 < self.speculative_acceptance < 1, "plan.rollout.speculative_acceptance", "must be in (0, 1)")
        _require(self.draft_cost_ratio >= 0, "plan.rollout.draft_cost_ratio", "must be >= 0")
        _require(self.logratio_std_per_step >= 0, "plan.rollout.logratio_std_per_step", "must be >= 0")
        _require(self.logratio_std_mismatch >= 0, "plan.rollout.logratio_std_mismatch", "must be >= 0")
        _require(0 <= self.drift_hot_token_share <= 1, "plan.rollout.drift_hot_token_share", "must be in [0, 1]")
        _require(self.drift_hot_std_multiplier >= 1, "plan.rollout.drift_hot_std_multiplier", "must be >= 1")


@dataclass(frozen=True, kw_only=True, slots=True)
class SearchConfig:
    enabled: bool = True
    """Search layouts (TP, PP, DP, v, schedule, micro-batch, recompute, rollout split)."""
    top_k: int = 10
    """Feasible layouts to report, fastest first."""
    min_headroom_fraction: float = 0.05
    """Share of the memory cap a recommended layout must leave free (tighter ones are listed, not recommended)."""

    def __post_init__(self) -> None:
        _require(self.top_k >= 1, "plan.search.top_k", "must be >= 1")
        _require(0 <= self.min_headroom_fraction < 1, "plan.search.min_headroom_fraction", "must be in [0, 1)")


@dataclass(frozen=True, kw_only=True)
class PlanConfig:
    """Everything a plan needs, in the planner's sections (the loader maps a run config onto them)."""

    model_shape: ModelShape
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    workload: WorkloadConfig = field(default_factory=WorkloadConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    search: SearchConfig = field(default_factory=SearchConfig)

    @property
    def training_gpus(self) -> int:
        if self.rollout.placement == "colocated":
            return self.cluster.num_gpus
        return self.cluster.num_gpus - (self.rollout.rollout_gpus or 0)

    @property
    def rollout_gpus(self) -> int:
        return self.cluster.num_gpus if self.rollout.placement == "colocated" else int(self.rollout.rollout_gpus or 0)

    @property
    def global_batch_size(self) -> int:
        """Samples per optimiser update: the whole step, as the runtime trains (one update a step)."""
        return self.workload.num_samples

    @property
    def num_microbatches(self) -> int:
        """m per DP replica: the runtime's own count (stages/train/plan.py) for padded rows of
        micro_batch_size sequences: whole groups per microbatch while they fit, rounded up to DP."""
        wl, tr = self.workload, self.train
        layout = microbatch_layout(wl.prompts_per_step, wl.group_size, wl.prompt_len, wl.gen_len,
                                   tr.micro_batch_size * self.seq_len, False, None, tr.data_parallel_size)
        return layout.num_microbatches // tr.data_parallel_size

    @property
    def seq_len(self) -> int:
        return self.workload.prompt_len + self.workload.gen_len

    def __post_init__(self) -> None:
        error = plan_layout_error(self)
        if error:
            raise PlanConfigError(error)


def _require(condition: bool, key: str, fix: str) -> None:
    if not condition:
        raise PlanConfigError(f"{key}: {fix}")


