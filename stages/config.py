"""Typed configuration of the stages: task, model, warm-up, rollout, reward, advantage, train.

The run schema that nests these (GRPOConfig, with cluster and MLflow settings and the checks that
span sections) is flows/config.py. Each field is documented once, here. Validation happens in
``__post_init__`` so an impossible setting fails before any work starts, with a one-line
:class:`ConfigError` naming the key and the fix. Parallel settings use the NeMo / Megatron names
(``tensor_model_parallel_size``, ``pipeline_model_parallel_size``, ...).
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional, Union

from stages.layout import SCHEDULES, ModelShape, ParallelLayout, attention_bias_of, layer_split_error
from stages.train.schedule import LR_SCHEDULES

__all__ = [
    "ConfigError",
    "require",
    "TaskConfig",
    "ModelConfig",
    "WarmupConfig",
    "RolloutConfig",
    "RewardConfig",
    "AdvantageConfig",
    "TrainConfig",
    "OffPolicyConfig",
    "IS_LEVELS",
    "IS_MODES",
    "PROXIMAL_SOURCES",
    "SCHEDULES",
    "LOSS_AGGREGATIONS",
    "POLICY_RATIOS",
    "ASYNC_OFF_POLICY",
    "effective_off_policy",
    "resolve_rollout_dtype",
]


class ConfigError(ValueError):
    """A configuration value is wrong; the message names the key and the fix."""


def require(ok: bool, message: str) -> None:
    """Raise :class:`ConfigError` with ``message`` unless ``ok``: every config section's checks."""
    if not ok:
        raise ConfigError(message)


def _in_range(key: str, value: float, low: float = 0.0, low_ok: bool = True) -> None:
    """``value`` finite and >= ``low`` (> ``low`` without ``low_ok``): an inf timeout would cancel
    every wait's limit, a NaN or inf rate trains non-finite weights."""
    ok = math.isfinite(value) and (value >= low if low_ok else value > low)
    require(ok, f"{key}={value} must be a finite number {'>=' if low_ok else '>'} {low:g}")


def _one_of(key: str, value: str, allowed: tuple[str, ...]) -> None:
    require(value in allowed, f"{key}={value!r} is not one of {', '.join(allowed)}")


LOSS_AGGREGATIONS = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm")
POLICY_RATIOS = ("token", "sequence")
ESTIMATORS = ("grpo", "dr_grpo")
KEEP_OPTIMIZER_STATE = ("latest", "all")
REFERENCE_PARALLEL = ("auto", "pipeline", "data")
REFERENCE_COMPUTE = ("auto", "always")
OVERLONG = ("keep", "mask")
REFERENCE_PASSES = ("separate", "fused")
ROLLOUT_DTYPES = ("auto", "float32", "bfloat16", "float16")
ROLLOUT_ENGINES = ("native", "vllm")
TRAIN_DEVICES = ("cpu", "cuda", "auto")
TRAIN_DTYPES = ("float32", "bfloat16")


@dataclass(frozen=True, kw_only=True, slots=True)
class TaskConfig:
    prompts_per_step: int = 16
    """Prompts per iteration, drawn from the ``dataset:`` section (stages/data); each gets
    ``rollout.group_size`` completions."""

    def __post_init__(self) -> None:
        require(self.prompts_per_step >= 1, "task.prompts_per_step must be >= 1")


@dataclass(frozen=True, kw_only=True, slots=True)
class ModelConfig:
    path: Optional[str] = None
    """An HF model folder (config.json, *.safetensors, tokenizer.json) to start from. When unset the
    base policy is the task's tiny model, made by a deterministic supervised warm-up and cached."""
    model_type: str = "llama"
    """Architecture family of the built-in model: llama or qwen2 (qwen2 carries q/k/v biases)."""
    vocab_size: Optional[int] = None
    """Embedding rows of the built-in model; unset: the task tokenizer's size (set it no smaller)."""
    hidden_size: int = 64
    intermediate_size: int = 176
    num_hidden_layers: int = 4
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    tie_word_embeddings: bool = False
    rope_theta: float = 10000.0

    def describe_notes(self) -> dict[str, str]:
        """With a model folder, the built-in model's keys below are not what runs: say so, and what does."""
        if not self.path:
            return {}
        folder = Path(self.path)
        try:
            hf = json.loads((folder / "config.json").read_text(encoding="utf-8"))
            sizes = ", ".join(f"{k} {hf[k]}" for k in ("model_type", "hidden_size", "intermediate_size",
                                                        "num_hidden_layers", "num_attention_heads",
                                                        "num_key_value_heads", "vocab_size",
                                                        "tie_word_embeddings") if k in hf)
        except (OSError, ValueError):
            sizes = "unreadable here"
        return {"model_type": f"NOT IN EFFECT from here to the end of model: (the built-in model's keys): "
                              f"{folder / 'config.json'} sets the model: {sizes}."}

    def __post_init__(self) -> None:
        require(
            self.hidden_size % max(self.num_attention_heads, 1) == 0,
            f"model.hidden_size={self.hidden_size} must be divisible by "
            f"model.num_attention_heads={self.num_attention_heads}",
        )
        try:
            self.shape()  # the shared shape's own checks (model_type, sizes, heads vs KV heads)
        except ValueError as exc:
            raise ConfigError(str(exc)) from None

    def shape(self, tokenizer_vocab_size: int = 1) -> ModelShape:
        """The built-in model's shape (stages/layout), head_dim = hidden_size / heads; the vocabulary
        is ``vocab_size`` when set, else ``tokenizer_vocab_size`` (train.logprob_chunk_tokens=auto reads it)."""
        return ModelShape(
            vocab_size=self.vocab_size or tokenizer_vocab_size, hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size, num_hidden_layers=self.num_hidden_layers,
            num_attention_heads=self.num_attention_heads, num_key_value_heads=self.num_key_value_heads,
            head_dim=self.hidden_size // self.num_attention_heads, tie_word_embeddings=self.tie_word_embeddings,
            attention_bias=attention_bias_of(self.model_type, None), model_type=self.model_type)


@dataclass(frozen=True, kw_only=True, slots=True)
class WarmupConfig:
    steps: int = 1200
    """Supervised steps that make the tiny base policy (kept short so GRPO starts below the ceiling)."""
    batch_size: int = 64
    lr: float = 3e-3

    def __post_init__(self) -> None:
        require(self.steps >= 0, f"warmup.steps={self.steps} must be >= 0")
        require(self.batch_size >= 1, f"warmup.batch_size={self.batch_size} must be >= 1")
        _in_range("warmup.lr", self.lr, low_ok=False)


@dataclass(frozen=True, kw_only=True, slots=True)
class RolloutConfig:
    group_size: int = 8
    """G: completions per prompt."""
    max_new_tokens: int = 6
    temperature: float = 1.0
    top_p: float = 1.0
    """Nucleus sampling mass kept; behav_logp is the log-prob under the truncated, renormalised
    distribution actually sampled from (stages/rollout/sampling.py)."""
    top_k: int = 0
    """Sample among the k most likely tokens only; 0: no top-k cut."""
    num_engines: int = 1
    """Generation engines (workers with the ``rollout`` resource); prompts are split between them."""
    page_size: int = 16
    """Tokens per block of the paged KV cache (stages/rollout/paged_kv.py)."""
    max_num_seqs: int = 256
    """Live sequences one decode step holds at most (continuous batching admits whole groups; the rest
    wait for finished ones' slots). On a GPU a decode step costs about the same at any batch size, so
    hold an engine's whole share there (prompts x G / num_engines): docs/performance.md, "Measured on
    an H200"."""
    max_staleness: int = 0
    """s: step k generates from policy version max(0, k - s), so the rollout pool generates steps
    k+1 .. k+s while the training ranks train step k (flows/async_schedule.py). 0: the synchronous
    loop, every step generated by the version it trains."""
    draft_layers: int = 0
    """Speculative decoding with a draft made of the policy's first draft_layers layers, its
    embeddings, final norm and head (stages/rollout/speculative.py): rebuilt from each version the
    engine loads, so the draft follows the policy. The draft proposes draft_tokens tokens, the policy
    verifies them in one forward; every emitted token is distributed as the policy samples it and
    behav_logp is the policy's log-prob, so the loss is unchanged. 0: off. Metrics:
    speculative_acceptance (share of drafted tokens accepted) and speculative_tokens_per_forward
    (tokens a sequence gains per policy forward)."""
    draft_path: Optional[str] = None
    """Speculative decoding with another HF model folder as the draft (same vocabulary as the
    policy), loaded once: it does not follow the policy's updates, so its acceptance may fall as the
    policy moves away from it. Exclusive with draft_layers."""
    draft_tokens: int = 4
    """k: draft tokens proposed per policy forward, with draft_layers or draft_path."""
    dynamic_sampling: bool = False
    """DAPO's dynamic sampling (Yu et al. 2025): a group whose rewards carry no signal (all equal,
    or fewer than two scored samples) is replaced by a group of a further prompt, generated in
    extra rounds of as many prompts as there are such groups, up to dynamic_sampling_rounds; the
    step trains the groups with a spread, or says how many slots it could not fill
    (groups_unfilled). Each engine fills its own share of the step. The extra prompts of round r of
    step k are deterministic in (seed, k, r) (stages/data/source.py), so a rerun or a resumed step
    regenerates the same rows. Needs reward.in_rollout (the engines score what they generate).
    Metrics: groups_generated, groups_dropped, groups_unfilled, sampling_rounds and
    generated_length_mean beside completion_length_mean (the trained samples' mean length)."""
    dynamic_sampling_rounds: int = 3
    """The most extra rounds of dynamic sampling per step and engine."""
    device: str = "auto"
    """Where the engines run: cpu, cuda, cuda:N, or auto (cuda when the engine's process sees a GPU,
    else cpu). Resolved on the engine's worker (stages/rollout/engine.py ``engine_placement``)."""
    dtype: str = "auto"
    """The engines' weights and KV cache: float32, bfloat16, float16, or auto (bfloat16 on CUDA,
    float32 on the CPU). Sampling runs in float32 either way, but below float32 the behaviour
    log-probs are the lower precision's, not the trainer's: unless train.off_policy is set, the loss
    is then decoupled PPO (stages/config.py effective_off_policy), its clip anchored at the
    trainer's own log-probs and each token weighted by the difference. auto stays float32 on every
    CPU: bfloat16 decoded 1.4-1.7x faster on CPUs with AVX-512 BF16 and 3.7x slower on one without
    (the run warns there, docs/performance.md)."""
    stop: list[str] = field(default_factory=list)
    """Stop strings: a completion ends at its first token whose text completes one of them (that
    token kept, as the model's EOS is, finish reason stop), e.g. ["</answer>"]; its EOS ids stop it
    too. Applied to every engine's samples as they come back (stages/rollout/rows.py), and to eval's."""
    engine: str = "native"
    """Which engine generates, behind one contract (stages/rollout/contract.py): native, the
    project's torch engine (stages/rollout/native.py: bit-reproducible, speculative decoding), or
    vllm, vLLM in a server process of its own under rollout.vllm_python, started once and kept,
    each version loaded into it in place (stages/rollout/vllm_engine.py; `make vllm` installs it,
    `make test` too). Both record the log-probs of the distribution they sampled from as behav_logp;
    the trainer's ratio to vLLM's starts a step within the two implementations' rounding of 1
    (kl_behav measures it). Evaluation runs on the same kind of engine."""
    vllm_python: Optional[str] = None
    """The Python of the vLLM environment; unset: $GRPOFLOW_VLLM_PYTHON, else .venv-vllm/bin/python in
    the project's folder."""
    vllm_kv_cache_bytes: int = 0
    """vLLM's KV-cache pool; 0: room for an engine's share of the step (max_num_seqs at most) at the
    step's prompt width + max_new_tokens, at least 64 MiB. A smaller pool only runs fewer sequences
    at once."""
    vllm_timeout_s: float = 600.0
    """The longest wait on the vLLM server: its start, a load, one generate call. Past it the server
    is stopped and the task fails; a server that died is started again once per call."""

    def __post_init__(self) -> None:
        require(self.group_size >= 2, "rollout.group_size must be >= 2 (a group needs a spread)")
        require(self.max_new_tokens >= 1, "rollout.max_new_tokens must be >= 1")
        require(self.temperature > 0, "rollout.temperature must be > 0")
        require(0 < self.top_p <= 1, "rollout.top_p must be in (0, 1]")
        require(self.top_k >= 0, "rollout.top_k must be >= 0 (0: off)")
        require(self.num_engines >= 1, "rollout.num_engines must be >= 1")
        require(self.page_size >= 1, "rollout.page_size must be >= 1")
        require(self.max_num_seqs >= self.group_size,
                 f"rollout.max_num_seqs={self.max_num_seqs} must be >= rollout.group_size={self.group_size}: "
                 "a group is admitted whole")
        require(self.draft_layers >= 0, f"rollout.draft_layers={self.draft_layers} must be >= 0 (0: no draft)")
        require(not (self.draft_layers and self.draft_path),
                 "rollout.draft_layers and rollout.draft_path both set: the draft is one or the other")
        require(self.draft_tokens >= 1, f"rollout.draft_tokens={self.draft_tokens} must be >= 1")
        require(self.dynamic_sampling_rounds >= 1,
                 f"rollout.dynamic_sampling_rounds={self.dynamic_sampling_rounds} must be >= 1")
        require(self.max_staleness >= 0, f"rollout.max_staleness={self.max_staleness} must be >= 0 (0: synchronous)")
        require(re.fullmatch(r"auto|cpu|cuda(:\d+)?", self.device) is not None,
                 f"rollout.device={self.device!r} must be auto, cpu, cuda or cuda:N")
        _one_of("rollout.dtype", self.dtype, ROLLOUT_DTYPES)
        _one_of("rollout.engine", self.engine, ROLLOUT_ENGINES)
        require(all(isinstance(s, str) and s for s in self.stop),
                 f"rollout.stop={self.stop!r}: each stop string must be a non-empty string")
        require(self.engine == "native" or not (self.draft_layers or self.draft_path),
                 "rollout.draft_layers / draft_path need rollout.engine=native: vLLM's own speculative decoding "
                 "is not wired")
        require(self.vllm_kv_cache_bytes >= 0, f"rollout.vllm_kv_cache_bytes={self.vllm_kv_cache_bytes} must be >= 0 "
                 "(0: sized from the step)")
        _in_range("rollout.vllm_timeout_s", self.vllm_timeout_s, low_ok=False)


@dataclass(frozen=True, kw_only=True, slots=True)
class RewardConfig:
    functions: list[str] = field(default_factory=lambda: ["exact_match"])
    """Reward functions: registered names (exact_match, math_answer, ...) or import paths
    ``package.module:function``, each called with ``prompt=``, ``completion=`` and the record's
    fields (``answer=`` ...); a sample's reward is their sum. Checked when the config loads."""
    num_tasks: int = 2
    """Parallel scoring tasks per step; each scores whole groups."""
    in_rollout: bool = False
    """Score inside the rollout tasks instead: each engine scores the groups it generated, writes
    their rewards and advantages with the rows and hands the step straight to the train tasks,
    while a gate sums up and marks the scores beside them (a reference task of its own waits for
    that gate; num_tasks is not used). The reward process then runs beside each engine. Off: the
    scoring tasks run on the plain workers, beside the reference pass (docs/performance.md)."""
    timeout_s: float = 5.0
    """Wall-clock limit for one sample's rewards; past it the scoring process is killed and the
    sample is a failed sample (left out of its group's statistics and of the loss)."""
    memory_limit_bytes: Optional[int] = 4 << 30
    """Address-space limit of the reward process (RLIMIT_AS); unset: no limit. Virtual memory, not
    resident: a reward module that imports torch needs well over 1 GiB of it."""
    overlong_buffer: int = 0
    """DAPO's soft overlong punishment: a completion longer than rollout.max_new_tokens - buffer
    tokens gets -overlong_penalty x (length - (max_new_tokens - buffer)) / buffer added to its
    reward, a linear ramp reaching -overlong_penalty at max_new_tokens (Yu et al. 2025). 0: off.
    Must be below rollout.max_new_tokens."""
    overlong_penalty: float = 1.0
    """The ramp's full penalty (at max_new_tokens), with overlong_buffer > 0."""
    max_failed_steps: int = 3
    """Stop the run after this many consecutive steps in which every sample's reward failed (a
    reward that raises, times out or returns no finite number on everything trains nothing); 0:
    never stop. Every step with a failed sample logs the count and the first failure's reason."""

    def __post_init__(self) -> None:
        from stages.reward import RewardFunctionError, check_reward_functions

        require(len(self.functions) >= 1, "reward.functions is empty: name at least one reward, e.g. [exact_match]")
        require(self.num_tasks >= 1, "reward.num_tasks must be >= 1")
        require(self.overlong_buffer >= 0, f"reward.overlong_buffer={self.overlong_buffer} must be >= 0 (0: off)")
        _in_range("reward.overlong_penalty", self.overlong_penalty)
        require(self.max_failed_steps >= 0, f"reward.max_failed_steps={self.max_failed_steps} must be >= 0 (0: never stop)")
        _in_range("reward.timeout_s", self.timeout_s, low_ok=False)
        require(self.memory_limit_bytes is None or self.memory_limit_bytes >= 1 << 24,
                 f"reward.memory_limit_bytes={self.memory_limit_bytes} must be >= 16 MiB (or unset)")
        try:
            check_reward_functions(self.functions)
        except RewardFunctionError as exc:
            raise ConfigError(str(exc)) from None


@dataclass(frozen=True, kw_only=True, slots=True)
class AdvantageConfig:
    estimator: str = "grpo"
    """grpo: A = (R - mean) / (std + eps); dr_grpo: A = R - mean (no std scaling)."""
    eps: float = 1e-6

    def __post_init__(self) -> None:
        _one_of("advantage.estimator", self.estimator, ESTIMATORS)


IS_LEVELS = ("token", "sequence", "geometric")
IS_MODES = ("none", "truncate", "mask")
PROXIMAL_SOURCES = ("current", "pass")


@dataclass(frozen=True, kw_only=True, slots=True)
class OffPolicyConfig:
    """Off-policy corrections and numerical guards of the loss (``train.off_policy``). The defaults
    leave the loss as the plain on-policy GRPO loss."""

    decoupled: bool = False
    """Decoupled PPO (Hilton et al. 2021; AReaL): clip r = pi_theta / pi_prox and weight each token
    by w = pi_prox / pi_behav (target channel prox_logp). False: clip pi_theta / pi_behav, w = 1."""
    proximal: str = "current"
    """Where pi_prox comes from. current: the trainer's weights at the start of the step, which are
    the weights its own forward runs with (one optimiser update per step), so pi_prox is that
    forward's log-prob, detached: no extra pass. pass: a forward-only ``proximal`` stage writes
    prox_logp to the store before train (the same values up to float rounding; a cross-check, and
    the form a multi-update step would need)."""
    is_level: str = "token"
    """token: w_t = exp(prox_t - behav_t). sequence: every token of sample i takes
    exp(sum_t (prox_t - behav_t)), the sequence likelihood ratio, unbiased but with a variance
    growing with length. geometric: exp(mean_t (prox_t - behav_t)), its per-token geometric mean,
    length-independent (GSPO, Zheng et al. 2025). The levels follow verl's rollout importance
    sampling (token / sequence / geometric; Yao et al. 2025, "Your efficient RL framework secretly
    brings you off-policy RL training"; Liu et al. 2025, "When speed kills stability")."""
    is_mode: str = "truncate"
    """none: w as is. truncate (TIS): min(w, is_cap). mask (MIS): tokens, or at the sequence levels
    whole sequences, with w > is_cap get weight 0 (dropped from the surrogate; KL stays)."""
    is_cap: float = 2.0
    """C, the TIS cap / MIS threshold; >= 1 so that on-policy weights (exactly 1) are untouched."""
    dual_clip: bool = False
    """Dual-clip PPO (Ye et al. 2020): for A < 0 the surrogate loss is at most -dual_clip_c * A."""
    dual_clip_c: float = 3.0
    """c of dual-clip (verl's clip_ratio_c, default 3); > 1."""
    kl_clamp: Optional[float] = None
    """Upper bound on each token's k3 KL (>= 0 by construction); None: unbounded."""
    log_ratio_clamp: float = 20.0
    """Every log-ratio is clamped to [-b, b] before exp: exp(20) = 4.9e8 stays finite in float32
    (max 3.4e38) even summed over tokens, and the gradient through a clamped value is 0."""

    def __post_init__(self) -> None:
        if self.proximal not in PROXIMAL_SOURCES:
            raise ConfigError(f"train.off_policy.proximal={self.proximal!r}: use one of {PROXIMAL_SOURCES}")
        if self.is_level not in IS_LEVELS:
            raise ConfigError(f"train.off_policy.is_level={self.is_level!r}: use one of {IS_LEVELS}")
        if self.is_mode not in IS_MODES:
            raise ConfigError(f"train.off_policy.is_mode={self.is_mode!r}: use one of {IS_MODES}")
        if not self.is_cap >= 1.0:
            raise ConfigError(f"train.off_policy.is_cap={self.is_cap} must be >= 1 (on-policy weights are 1)")
        if not self.dual_clip_c > 1.0:
            raise ConfigError(f"train.off_policy.dual_clip_c={self.dual_clip_c} must be > 1 (verl uses 3)")
        if self.kl_clamp is not None and not self.kl_clamp > 0:
            raise ConfigError(f"train.off_policy.kl_clamp={self.kl_clamp} must be > 0, or unset")
        if not self.log_ratio_clamp > 0:
            raise ConfigError(f"train.off_policy.log_ratio_clamp={self.log_ratio_clamp} must be > 0 (e.g. 20)")


@dataclass(frozen=True, kw_only=True, slots=True)
class TrainConfig:
    pipeline_model_parallel_size: int = 2
    """p: pipeline ranks. Training ranks (Dask workers with the ``train`` resource) = p x dp x tp."""
    tensor_model_parallel_size: int = 1
    """tp: attention heads and MLP columns split over this many ranks (Megatron column/row parallel)."""
    data_parallel_size: int = 1
    """dp: pipeline replicas; each takes whole groups of the global batch, gradients are summed."""
    virtual_pipeline_model_parallel_size: int = 1
    """v: stages per pipeline rank. 1 for gpipe / 1f1b / zb-h1, >= 2 for interleaved-1f1b (rank r holds
    stages r, r + p, ...), exactly 2 for zbv / dualpipev (a V: rank r holds r and 2p - 1 - r)."""
    layer_split: Union[list[int], str] = "auto"
    """Decoder layers of each of the p x v stages in order, e.g. [19, 11]: each >= 1, summing to the
    model's num_hidden_layers. The first stage also holds the embedding (a gather, no FLOPs), the
    last the final norm, lm_head and the loss's log-softmax. auto: the split minimising the slowest
    stage's forward + backward FLOPs, the head weighing h layers on the last stage: its lm_head FLOPs
    2 V d per projected token over a layer's per token (attention at the longest sequence S). Full
    logits project every position; with logprob_chunk_tokens only the sampled completion tokens (x
    4/3: the backward recomputes their logits), counted at half of max_new_tokens, which keeps the
    slowest stage within half the full-length head's weight of balance whatever the lengths
    (stages/layout/pipeline.py ``balanced_layer_split``, planner/training.py ``estimate_head_layers``).
    SmolLM2-135M (V 49,152, d 576) at S = 144: h = 7.8 with full logits, 19 / 11 for the even 15 /
    15 (the slower stage measured 3.79 -> 3.17 s a microbatch); chunked over 48 new tokens
    (configs/smollm2-arithmetic.yaml) 1.7, 16 / 14. A tiny vocabulary (h < 1) keeps the even split.
    The gradient is the same whatever the split."""
    micro_batch_size: int = 32
    """Samples per microbatch of the padded layout: sets the token budget when
    max_tokens_per_microbatch is unset."""
    max_tokens_per_microbatch: Optional[int] = None
    """B: token slots of one microbatch, padding included (rows x row length, the same every step).
    Unset: micro_batch_size x (task prompt width + rollout.max_new_tokens). Whole groups fill a
    microbatch while they fit (a group is split only if it alone does not fit); the microbatch count
    is the worst case's, every completion at max_new_tokens (stages/train/plan.py)."""
    packing: Union[bool, str] = "auto"
    """Pack sequences end to end in rows (doc ids, positions restarting per sequence) instead of one
    right-padded sequence per row. auto: on with length buckets (rows of each bucket's width: packed
    passes ran ~0.55x the time of padded ones) or with pack_row_tokens set, else off (one pass
    shaped for the worst case holds the same slots either way, and dense-mask attention over longer
    rows makes packing slower): docs/performance.md, "Defaults and what auto picks"."""
    pack_row_tokens: Optional[int] = None
    """Packing only: slots per packed row, in [longest sequence, the budget]; unset: one row per
    microbatch (the varlen layout). Short rows keep dense attention cheap."""
    length_buckets: Optional[Union[list[int], str]] = "auto"
    """Row widths T_b of length buckets, e.g. [16, 32, 64] (the longest sequence S = prompt width +
    max_new_tokens is always one; packed, widths above S, up to the budget, are rows that hold two
    or more sequences). Set: a step runs a variable number of pipeline passes, each
    of one bucket's fixed row shape [budget // T_b rows, T_b] and as many microbatches as the
    bucket's groups fill (see max_microbatches_per_pass), a group going to the narrowest bucket
    holding its longest sequence; gradients accumulate over the passes before one optimiser step
    (stages/train/buckets.py). Unset (null): every step is one pass shaped for the worst case (every
    completion at max_new_tokens). auto: powers of two from 16 up to S / 2, then S (S = 71: [16, 32,
    71], packed, half the bench shape's worst-case step time), then 2S when not padded, the budget
    holds a 2S row and dense attention over S more keys costs at most 10% of a token's layer FLOPs
    (SmolLM2 at 4.7%: [16, 32, 64, 144, 288], 10-25% fewer slots a step); unset when S < 32 (the
    tiny config's 13: buckets changed nothing there); unset too with pack_row_tokens
    (stages/train/auto.py; docs/performance.md, "Defaults and what auto picks")."""
    max_microbatches_per_pass: Optional[int] = None
    """With length_buckets: the most microbatches (per data-parallel rank) one pass runs. Unset: one
    pass per bucket (one pipeline fill and drain each); the schedule's smallest count (p for 1F1B)
    gives fixed-count passes. Each (bucket, count) pair has its own cached schedule, and each keeps
    torch's receive buffers for its microbatches: at large activations a cap bounds that memory."""
    logprob_chunk_tokens: Optional[Union[int, str]] = "auto"
    """Set: the last stage returns hidden states and the loss applies lm_head and log-softmax to this
    many completion tokens at a time, so [tokens x vocab] logits never exist; unset: full logits.
    auto: 256 when the model's vocabulary has >= 8,192 tokens (only completion positions are
    projected: the loss took 0.3-0.9x the full logits' time with up to 3/4 of the positions
    scored), else unset (the tiny vocabulary: full logits are cheaper there)."""
    schedule: str = "1f1b"
    """Pipeline schedule: gpipe, 1f1b, interleaved-1f1b, zb-h1, zbv or dualpipev."""
    lr: Union[float, int, str] = "auto"
    """AdamW's peak learning rate; each step's rate follows lr_schedule (stages/train/schedule.py
    ``lr_at``, a function of the step alone, so a resumed run trains at the same rates) and is
    logged as the metric ``lr``. auto: 1e-3 for the built-in model, 2e-5 for a pretrained model
    (model.path), the rates measured on each (stages/train/auto.py)."""
    lr_schedule: str = "constant"
    """After the warm-up: constant (lr), linear (lr down to the floor in a line) or cosine (lr down
    to the floor along half a cosine), decaying over lr_decay_steps and staying at the floor after."""
    lr_warmup_steps: int = 0
    """W: steps whose rate ramps up, lr x (step + 1) / (W + 1) at 0-based step < W; 0: no warm-up."""
    lr_decay_steps: Optional[int] = None
    """D: steps over which linear / cosine decay after the warm-up; the floor is reached at step W + D.
    Unset: iterations - W, so the rate depends on ``iterations``: a resume that changes iterations
    changes the remaining steps' rates; set it to keep them."""
    lr_min_ratio: float = 0.0
    """The floor of linear / cosine, a fraction of lr in [0, 1]."""
    weight_decay: float = 0.0
    max_grad_norm: float = 1.0
    clip_eps_low: float = 0.2
    clip_eps_high: float = 0.2
    kl_beta: float = 0.02
    """Weight of the k3 KL estimate to the reference policy."""
    loss_aggregation: str = "token-mean"
    policy_ratio: str = "token"
    """token: GRPO's per-token ratio pi_theta / pi_old, clipped per token. sequence: GSPO (Zheng et
    al. 2025), one ratio per completion, the geometric mean of its tokens' ratios, clipped per
    sequence, its surrogate given to each of its tokens (the k3 KL stays per token); its objective
    is the paper's with loss_aggregation seq-mean-token-mean. On-policy both give the same
    gradient (stages/train/loss.py)."""
    off_policy: Optional[OffPolicyConfig] = None
    """Importance weights and clamps of the loss (stages/train/loss.py OffPolicyConfig). Unset: decoupled
    PPO with token-level TIS capped at 2 where the behaviour log-probs are not the trainer's own
    (rollout.max_staleness >= 1, rollout.engine not native, or bfloat16 or float16 in rollout.dtype
    or train.dtype), the plain on-policy loss otherwise (:func:`effective_off_policy`). Set (any
    key): exactly this section, whose decoupled defaults to false."""
    timeout_s: float = 120.0
    """Limit on every distributed wait (process-group init, send/recv, collectives); a failed or stuck
    rank ends the training step on every rank within it."""
    device: str = "cpu"
    """Where the training ranks compute: cpu; cuda, a GPU per rank (rank r on GPU r mod the count;
    NCCL between them, gloo for host tensors); auto, cuda when the machine has a GPU per rank, else
    cpu (stages/train/engine.py ``train_placement``)."""
    dtype: str = "float32"
    """float32, or bfloat16: every forward of the policy and the reference runs under torch.autocast
    (weights, gradients and AdamW's state stay float32); unless train.off_policy is set, the loss is
    then decoupled PPO with TIS (effective_off_policy). On a CPU with AVX-512 BF16, bfloat16 here
    and in rollout.dtype ran 16 steps of configs/smollm2-arithmetic.yaml in 0.76x float32's time,
    held-out accuracy the same within its noise; on one without, bfloat16 matmuls are far slower
    than float32 ones (140x on a 2-core AMD EPYC VM): the run warns with the host's measured rates
    (docs/performance.md). The default is float32: the exactness checks (bit for bit against one
    process, resume, replay) hold in float32."""
    overlong: str = "keep"
    """Completions cut at rollout.max_new_tokens (finish reason "length"): keep trains them like
    finished ones; mask leaves them out of the loss (DAPO's overlong filtering) while they still
    count in their group's reward statistics, so the advantages of the group's other samples are
    unchanged. Either way the step logs truncated_fraction."""
    reference: str = "auto"
    """When the frozen reference's log-probs are computed. auto: only when the loss uses them
    (kl_beta > 0); at kl_beta 0 the step has no reference stage, the ranks hold no reference copy,
    the ``kl`` metric is not logged, and the trained weights are the same bit for bit as with the
    pass (0 x KL adds nothing). always: at kl_beta 0 too, to log ``kl`` (the drift from the
    reference) while nothing pulls towards it."""
    reference_parallel: str = "auto"
    """How the training ranks run the frozen reference's forward pass. auto: data when
    tensor_model_parallel_size is 1 and the whole model has at most 2 B parameters (every rank can
    hold it beside its stages), else pipeline. pipeline: split into the
    pipeline's stages like the policy (each rank holds its stages' share; a pass pays the
    pipeline's fill, drain and a hand-off per microbatch). data: every rank holds the whole
    reference and runs its share of the microbatches on its own, then one reduction gathers the
    log-probs (the same values, bit for bit); for models small enough that every rank can hold the
    whole reference beside its policy stages, where it is faster (docs/performance.md). Needs
    tensor_model_parallel_size 1."""
    reference_pass: str = "separate"
    """Where the frozen reference's pass runs in a step's graph. separate: a task per training rank
    of its own, after the rollout and beside the reward scoring; its log-probs are stored and the
    train tasks read them back. fused: inside the train tasks, over the step's own batch, right
    before the optimiser step (TrainRank.train_step_with_reference): one dispatch, one read of the
    step and one batch build fewer, for the scoring no longer running beside it. The log-probs are
    stored as well, and the gradient is the separate pass's bit for bit."""
    reference_fill: Union[bool, str] = "auto"
    """With reference_pass=fused: whether some of the reference's microbatches run inside the
    training step's P2P waits instead of before it. auto: where it can, i.e. the reference
    whole on every rank (reference_parallel resolves to data), training on the CPU, two or more
    pipeline ranks; each rank offers 80% of the longest wait its previous step of the same pass
    shape measured (in 1F1B, the first stage's after its warm-up forwards, or a pass's drain for
    the step's later passes), the microbatches that fit there leave the pre-step pass and the rest
    is balanced over the ranks, where that shortens it (stages/train/fill.py). A step where
    nothing fits is the plain fused step. The log-probs, and so the step, are the same bits either
    way (docs/performance.md). false: the whole pass before the step."""
    keep_optimizer_state: str = "latest"
    """Which policy versions keep the ranks' AdamW state (twice the weights' bytes in float32).
    latest: a version's state is deleted once the step after the one starting from it is logged:
    the versions the last logged step started from and published keep theirs, so a run resumes
    where it stopped, or reruns its last logged step, as with all. all: every version keeps it (to
    restart training from any version). Safe to change on resume."""
    keep_versions: Optional[int] = 3
    """Policy versions kept whole (weights) besides the ones below: the newest N. An older one's
    weights and optimiser state are deleted once the step publishing N versions after it is logged;
    its manifest, config and tokenizer stay. Always kept: v0 (the reference), every train.keep_every-th
    version, every version the held-out evaluation scores (eval.every_steps) and the run's last.
    null: keep every version. Raised to rollout.max_staleness + 2 when below (the versions a resumed
    or in-flight step may start from).
    About 4 bytes a parameter a version saved (SmolLM2-135M: 0.5 GB). Safe to change on resume."""
    keep_every: int = 10
    """With train.keep_versions: every K-th version is kept whole too (v10, v20, ...); 0: none."""

    def __post_init__(self) -> None:
        _one_of("train.schedule", self.schedule, SCHEDULES)
        _one_of("train.keep_optimizer_state", self.keep_optimizer_state, KEEP_OPTIMIZER_STATE)
        require(self.keep_versions is None or self.keep_versions >= 1,
                 f"train.keep_versions={self.keep_versions} must be >= 1 (or null to keep every version)")
        require(self.keep_every >= 0, f"train.keep_every={self.keep_every} must be >= 0 (0: no periodic versions)")
        _one_of("train.loss_aggregation", self.loss_aggregation, LOSS_AGGREGATIONS)
        _one_of("train.policy_ratio", self.policy_ratio, POLICY_RATIOS)
        _one_of("train.reference", self.reference, REFERENCE_COMPUTE)
        _one_of("train.overlong", self.overlong, OVERLONG)
        _one_of("train.reference_parallel", self.reference_parallel, REFERENCE_PARALLEL)
        _one_of("train.reference_pass", self.reference_pass, REFERENCE_PASSES)
        require(self.reference_fill in ("auto", False),
                f"train.reference_fill={self.reference_fill!r} must be auto or false")
        _one_of("train.device", self.device, TRAIN_DEVICES)
        _one_of("train.dtype", self.dtype, TRAIN_DTYPES)
        for key in ("pipeline_model_parallel_size", "tensor_model_parallel_size", "data_parallel_size",
                    "virtual_pipeline_model_parallel_size", "micro_batch_size"):
            require(getattr(self, key) >= 1, f"train.{key}={getattr(self, key)} must be >= 1")
        if self.layer_split != "auto":  # the sum is checked against the model (GRPOConfig)
            require(isinstance(self.layer_split, (list, tuple)),
                     f"train.layer_split={self.layer_split!r} must be auto or a list of layers per stage")
            split_error = layer_split_error(self.layer_split, None, self.pipeline_model_parallel_size
                                            * self.virtual_pipeline_model_parallel_size)
            require(split_error is None, split_error or "")
        _in_range("train.timeout_s", self.timeout_s, low_ok=False)
        if self.lr != "auto":  # "1e-5" on a command line is a string to YAML, "1" an int
            try:
                object.__setattr__(self, "lr", float(self.lr))  # frozen: normalised once, here
            except (TypeError, ValueError):
                raise ConfigError(f"train.lr={self.lr!r} must be auto or a number > 0") from None
        if self.lr != "auto":
            _in_range("train.lr", self.lr, low_ok=False)
        _one_of("train.lr_schedule", self.lr_schedule, LR_SCHEDULES)
        require(self.lr_warmup_steps >= 0,
                 f"train.lr_warmup_steps={self.lr_warmup_steps} must be >= 0 (0: no warm-up)")
        require(self.lr_decay_steps is None or self.lr_decay_steps >= 1,
                 f"train.lr_decay_steps={self.lr_decay_steps} must be >= 1 (or unset: iterations - lr_warmup_steps)")
        require(math.isfinite(self.lr_min_ratio) and 0 <= self.lr_min_ratio <= 1,
                 f"train.lr_min_ratio={self.lr_min_ratio} must be in [0, 1] (a fraction of train.lr)")
        require(self.lr_schedule != "constant" or (self.lr_decay_steps is None and self.lr_min_ratio == 0),
                 "train.lr_decay_steps / train.lr_min_ratio are set but train.lr_schedule=constant does not decay: "
                 "set train.lr_schedule=linear or cosine, or unset them")
        for key in ("weight_decay", "max_grad_norm", "kl_beta"):
            _in_range(f"train.{key}", getattr(self, key))
        for key in ("max_tokens_per_microbatch", "pack_row_tokens"):
            value = getattr(self, key)
            require(value is None or value >= 1, f"train.{key}={value} must be >= 1 (or unset)")
        chunk, buckets = self.logprob_chunk_tokens, self.length_buckets
        require(chunk in (None, "auto") or (isinstance(chunk, int) and chunk >= 1),
                 f"train.logprob_chunk_tokens={chunk} must be >= 1, auto or unset")
        require(buckets in (None, "auto") or (isinstance(buckets, (list, tuple)) and len(buckets) >= 1
                                               and all(isinstance(w, int) and w >= 2 for w in buckets)),
                 f"train.length_buckets={buckets} must list row widths >= 2, or be auto or unset")
        require(self.packing in (True, False, "auto"), f"train.packing={self.packing!r} must be true, false or auto")
        require(self.max_microbatches_per_pass is None or self.max_microbatches_per_pass >= 1,
                 f"train.max_microbatches_per_pass={self.max_microbatches_per_pass} must be >= 1 (or unset)")
        require(not isinstance(buckets, (list, tuple)) or self.pack_row_tokens is None,
                 "train.pack_row_tokens is set with train.length_buckets: packed rows take the bucket widths; "
                 "unset one of them")
        require(self.packing is not False or self.pack_row_tokens is None,
                 f"train.pack_row_tokens={self.pack_row_tokens} is set but train.packing=false: "
                 "set train.packing=true or unset it")
        require(0 <= self.clip_eps_low < 1, "train.clip_eps_low must be in [0, 1)")
        require(self.clip_eps_high >= 0, "train.clip_eps_high must be >= 0")

    @property
    def uses_reference(self) -> bool:
        """Whether a step computes the frozen reference's log-probs (``reference``)."""
        return self.kl_beta > 0 or self.reference == "always"

    @property
    def world_size(self) -> int:
        """Training ranks: pipeline x data x tensor parallel."""
        return self.pipeline_model_parallel_size * self.data_parallel_size * self.tensor_model_parallel_size

    @property
    def layout(self) -> ParallelLayout:
        """The (pp, dp, tp) mesh of the training ranks and their stages (stages/layout/mesh.py)."""
        return ParallelLayout(self.pipeline_model_parallel_size, self.data_parallel_size,
                              self.tensor_model_parallel_size, self.virtual_pipeline_model_parallel_size,
                              self.schedule)


def resolve_rollout_dtype(dtype: str, on_cuda: bool) -> str:
    """rollout.dtype as the engines run it: auto is bfloat16 on CUDA, float32 on the CPU; any other
    spelling is itself."""
    if dtype != "auto":
        return dtype
    return "bfloat16" if on_cuda else "float32"


# The planner's recommendation for staleness >= 1 (docs/design-70b/report.md, Section 4): decoupled
# PPO anchored on the trainer's current weights, token-level truncated importance weights, cap 2.
ASYNC_OFF_POLICY = OffPolicyConfig(decoupled=True, proximal="current", is_level="token", is_mode="truncate",
                                   is_cap=2.0)


def effective_off_policy(train: TrainConfig, max_staleness: int, engine: str = "native",
                         engine_dtype: str = "float32") -> OffPolicyConfig:
    """The loss's off-policy section: train.off_policy when set, else :data:`ASYNC_OFF_POLICY`
    wherever the behaviour log-probs are not the trainer's own, and the on-policy default otherwise.
    They are not its own at max_staleness >= 1; with a rollout engine other than the trainer's
    decoder (vLLM's kernels round differently); and wherever either side computes in less than
    float32 (``engine_dtype``, the engines' rollout.dtype resolved, GRPOConfig.engine_dtype; or
    train.dtype): bfloat16 engines and a bfloat16-autocast trainer round differently, even against
    each other (KL(behaviour || trainer) 2.4e-3-3.1e-3 per token on SmolLM2 before any update,
    docs/performance.md). TIS then weights each token by that mismatch."""
    if train.off_policy is not None:
        return train.off_policy
    own = max_staleness == 0 and engine == "native" and engine_dtype == "float32" and train.dtype == "float32"
    return OffPolicyConfig() if own else ASYNC_OFF_POLICY
