"""The run config: the stage configs of stages/config.py, plus cluster and MLflow settings, the
checks that span sections (batch split, tensor split, microbatch layout, schedule), and its loader
(:func:`load_config`: YAML + ``key=value`` overrides, checked against the typed config).

It lives in flows/ because it describes a whole run, wiring included; stages/ never imports it.
"""
from __future__ import annotations

import dataclasses
import hashlib
import ipaddress
import math
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from stages.config import (AdvantageConfig, ConfigError, ModelConfig, OffPolicyConfig, RewardConfig, RolloutConfig,
                           TaskConfig, TrainConfig, WarmupConfig, effective_off_policy, require,
                           resolve_rollout_dtype)
from stages.data import DatasetConfig, DatasetError
from stages.eval import EvalConfig
from stages.layout import ModelShape, balanced_layer_split, layer_split_error, parallel_layout_error, shape_from_hf
from stages.tasks.addition import vocab_size as addition_vocab_size
from stages.train.auto import auto_length_buckets, auto_logprob_chunk_tokens, auto_lr, auto_packing
from stages.train.buckets import BucketedLayout, bucketed_layout, microbatches_per_pass
from stages.train.plan import MicrobatchLayout, microbatch_layout
from storage.model_folder import ModelFolderError, load_hf_config

__all__ = ["ConfigError", "PLACEMENTS", "WEIGHT_SYNCS", "ClusterConfig", "MlflowConfig", "GRPOConfig", "config_hash",
           "config_to_dict", "load_config", "load_run_folder_config"]


PLACEMENTS = ("colocated", "decoupled")
WORKER_SILENCE_S = 60.0  # cluster.worker_silence_s's default
WEIGHT_SYNCS = ("memory", "disk")
CONTENT_HASHES = ("verify", "send", "none")
# train.reference_parallel=auto holds the whole reference on every rank up to this size (8 GB in float32).
_WHOLE_REFERENCE_MAX_PARAMS = 2_000_000_000


def _first_line(exc: BaseException) -> str:
    return str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__


def _is_host(value: str) -> bool:
    """An IPv4 address, or a host name (letters, digits, '-' and '.'). IPv6 is not supported yet:
    the rendezvous parses worker addresses as host:port."""
    try:
        return ipaddress.ip_address(value).version == 4
    except ValueError:
        return bool(value) and all(part and part.replace("-", "").isalnum() for part in value.split("."))


@dataclass(frozen=True, kw_only=True, slots=True)
class ClusterConfig:
    scheduler_address: Optional[str] = None
    """Connect to this Dask scheduler instead of starting an embedded local cluster."""
    listen: str = "127.0.0.1"
    """Embedded cluster: the address every server of the run listens on: the scheduler, each nanny
    and worker, their dashboards, and (through rank 0's worker address) the training ranks' and the
    weight sync's TCPStores. Dask's protocol and the TCPStore have no authentication: whoever
    reaches a worker's port can run code in it. Loopback keeps that to this machine; any other
    address exposes the run to everyone who can reach that interface. Runs across hosts use
    cluster.scheduler_address with workers started there, over TLS (docs/reliability.md); the
    TCPStores then listen on rank 0's worker address only."""
    num_plain_workers: int = 1
    """Embedded cluster: workers without resources (reward, advantage, IO)."""
    placement: str = "decoupled"
    """Embedded cluster: colocated gives the first rollout.num_engines training workers the rollout
    resource too (one pool for both phases; so at most train's world size of engines); decoupled
    starts rollout.num_engines separate rollout workers."""
    colocated: Optional[bool] = None
    """Replaced by cluster.placement; setting it is an error that names the new key."""
    rollout_threads: int = 0
    """torch threads of each rollout task; 0 (auto): this host's cores shared by the workers busy
    while rollouts run (the engines, plus the training ranks when steps overlap), at least 1
    (flows/tasks.py ``phase_threads``)."""
    train_threads: int = 0
    """torch threads of each training-rank task (train, reference, proximal); 0 (auto): the cores
    shared by the training ranks (plus the engines when steps overlap), at least 1."""
    iteration_timeout_s: float = 900.0
    """An iteration whose stages have not all finished by then fails, naming the late stages."""
    max_restarts: int = 2
    """A step that loses a training worker is re-run, after every rank is rebuilt from the last
    published version, at most this many times; then the run fails."""
    worker_wait_s: float = 60.0
    """Longest wait for workers to join: at start-up, and for restarted workers to come back."""
    worker_silence_s: float = WORKER_SILENCE_S
    """A training worker the scheduler has had no heartbeat from for this long (a stopped or
    deadlocked process: its peers' collectives end at train.timeout_s, its own task never does) is
    lost: its nanny kills it and the step is rerun on rebuilt ranks, as for a dead one."""
    worker_profiler: bool = False
    """Embedded cluster: Dask's statistical profiler on the workers (the dashboard's Profile tab). It
    samples every thread's stack every 10 ms, which cost the training ranks ~10% of their step at
    the tiny config (docs/performance.md); off unless asked for."""
    weight_sync: str = "disk"
    """How a new policy version reaches the rollout engines. disk: the engine loads the published
    folder. memory: the pipeline ranks also broadcast it to the engines right after the optimiser
    step (torch.distributed: gloo on CPU, NCCL for CUDA tensors) and the engine takes the weights
    it received; a version it did not receive (the one the ranks were built from, a failed send, a
    replaced engine) comes from disk. The published folders are written either way
    (flows/weight_sync.py; docs/performance.md compares the two)."""
    weight_sync_timeout_s: float = 60.0
    """memory: bound of every weight-sync wait (the channel's rendezvous, each broadcast, an engine
    waiting for a version that is on its way)."""
    weight_sync_content_hash: str = "verify"
    """memory: verify (the ranks send a sha256 per tensor, the engine checks the bytes it got),
    send (the engine only combines the ranks' digests into the version's content hash) or none."""

    def __post_init__(self) -> None:
        require(self.colocated is None,
                 f"cluster.colocated={self.colocated} is replaced: set cluster.placement="
                 f"{'colocated' if self.colocated else 'decoupled'} instead")
        require(self.placement in PLACEMENTS,
                 f"cluster.placement={self.placement!r} is not one of {', '.join(PLACEMENTS)}")
        require(self.rollout_threads >= 0, f"cluster.rollout_threads={self.rollout_threads} must be >= 0 (0: auto)")
        require(self.train_threads >= 0, f"cluster.train_threads={self.train_threads} must be >= 0 (0: auto)")
        require(self.num_plain_workers >= 0, "cluster.num_plain_workers must be >= 0")
        require(_is_host(self.listen),
                 f"cluster.listen={self.listen!r} must be an IPv4 address or host name without a port "
                 "(127.0.0.1: this machine only)")
        for key in ("iteration_timeout_s", "worker_wait_s", "worker_silence_s", "weight_sync_timeout_s"):
            value = getattr(self, key)
            require(math.isfinite(value) and value > 0, f"cluster.{key}={value} must be a finite number > 0 "
                     "(every wait of the run has a limit)")
        require(self.max_restarts >= 0, "cluster.max_restarts must be >= 0 (0: a lost training worker fails the run)")
        require(self.weight_sync in WEIGHT_SYNCS,
                 f"cluster.weight_sync={self.weight_sync!r} is not one of {', '.join(WEIGHT_SYNCS)}")
        require(self.weight_sync_content_hash in CONTENT_HASHES,
                 f"cluster.weight_sync_content_hash={self.weight_sync_content_hash!r} is not one of "
                 f"{', '.join(CONTENT_HASHES)}")

    @property
    def colocated_pools(self) -> bool:
        """Training workers also generate."""
        return self.placement == "colocated"


@dataclass(frozen=True, kw_only=True, slots=True)
class MlflowConfig:
    tracking_uri: Optional[str] = None
    """MLflow tracking URI; unset means sqlite in the run folder (runs/<run_name>/mlflow.db)."""
    experiment: str = "grpoflow"
    plot_every_steps: int = 10
    """Redraw the parent run's reward, stage-seconds and bubble plots every this many steps (and at
    the end), and print one decoded sample in the terminal as often."""
    plot_min_interval_s: float = 30.0
    """Skip a redraw due less than this many seconds after the last one (the three plots cost ~0.3
    CPU-seconds, which short steps would pay every few seconds); the end of the run always redraws."""
    sample_groups: int = 2
    """Groups of decoded samples (prompt, completion, reward, advantage) in each step's table; 0: none."""

    def __post_init__(self) -> None:
        require(self.plot_every_steps >= 1, "mlflow.plot_every_steps must be >= 1")
        require(self.plot_min_interval_s >= 0, "mlflow.plot_min_interval_s must be >= 0")
        require(self.sample_groups >= 0, "mlflow.sample_groups must be >= 0")


def resolve_reference_parallel(train: TrainConfig, shape: ModelShape | None) -> str:
    """train.reference_parallel with auto resolved for a model of ``shape`` (needed only for auto
    at tensor_model_parallel_size 1): :attr:`GRPOConfig.reference_parallel`."""
    if train.reference_parallel != "auto":
        return train.reference_parallel
    if train.tensor_model_parallel_size > 1 or shape is None:
        return "pipeline"
    h = shape.hidden_size
    layer = h * (2 * shape.q_dim + 2 * shape.kv_dim) + 3 * h * shape.intermediate_size  # attention + SwiGLU
    params = shape.vocab_size * h * (1 if shape.tie_word_embeddings else 2) + shape.num_hidden_layers * layer
    return "data" if params <= _WHOLE_REFERENCE_MAX_PARAMS else "pipeline"


@dataclass(frozen=True, kw_only=True, slots=True)
class GRPOConfig:
    run_name: str = "tiny"
    """The run's folder name under runs_dir (storage/run_folder.py) and its MLflow run name."""
    runs_dir: str = "runs"
    """Folder holding one folder per run, and the shared base-policy cache (_cache)."""
    seed: int = 0
    """Seeds prompts, sampling and the warm-up: a rerun of a step regenerates the same rows."""
    iterations: int = 20
    """GRPO iterations (steps) of the run; a rerun continues after the last published one."""
    task: TaskConfig = field(default_factory=TaskConfig)
    dataset: DatasetConfig = field(default_factory=DatasetConfig)
    """Where prompts come from (stages/data/config.py documents each key): the built-in addition task
    by default, or a JSONL / Parquet / saved HF datasets file of your own."""
    model: ModelConfig = field(default_factory=ModelConfig)
    warmup: WarmupConfig = field(default_factory=WarmupConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    advantage: AdvantageConfig = field(default_factory=AdvantageConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    mlflow: MlflowConfig = field(default_factory=MlflowConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    """Held-out evaluation of the base policy, every eval.every_steps versions and the last one
    (stages/eval/config.py documents each key; flows/evaluate.py runs it). Off unless eval.path is set."""
    plan: dict[str, Any] = field(default_factory=dict)
    """Planner-only settings (cluster, search, activation accounting; planner/config.py documents
    them). The run ignores this section, so `grpoflow plan` can read the run's own config."""

    def __post_init__(self) -> None:
        require(self.iterations >= 1, "iterations must be >= 1")
        require(
            self.run_name and all(c.isalnum() or c in "-_." for c in self.run_name),
            f"run_name={self.run_name!r} may hold only letters, digits, '-', '_' and '.'",
        )
        # '.' and '..' would put the run into runs_dir itself or its parent; '_cache' and '_eval'
        # are runs_dir's shared folders (storage/run_folder.py, grpoflow eval).
        require(not self.run_name.startswith(".") and self.run_name not in ("_cache", "_eval"),
                 f"run_name={self.run_name!r} may not start with '.' nor be _cache or _eval (folders of runs_dir)")
        require(self.reward.overlong_buffer < self.rollout.max_new_tokens,
                 f"reward.overlong_buffer={self.reward.overlong_buffer} must be below rollout.max_new_tokens="
                 f"{self.rollout.max_new_tokens} (the ramp ends at max_new_tokens)")
        require(self.reward.in_rollout or not self.rollout.dynamic_sampling,
                 "rollout.dynamic_sampling replaces groups the engines score themselves: set reward.in_rollout=true")
        self._check_dataset()
        self._check_parallel_layout()
        self._check_placement()

    def _check_placement(self) -> None:
        """The embedded cluster's colocated engines are training workers: no more than there are
        (a cluster of one's own, cluster.scheduler_address, may offer the rollout resource elsewhere)."""
        world, engines = self.train.world_size, self.rollout.num_engines
        require(self.cluster.scheduler_address or not self.cluster.colocated_pools or engines <= world,
                 f"rollout.num_engines={engines} exceeds the {world} training workers that hold the engines with "
                 f"cluster.placement=colocated: set rollout.num_engines <= {world} or cluster.placement=decoupled")

    def _check_dataset(self) -> None:
        d = self.dataset
        if d.kind != "addition":
            require(self.model.path is not None,
                     f"dataset.kind={d.kind} needs model.path (an HF model folder with its tokenizer): the "
                     "built-in tiny model only knows the addition task")
            require(d.max_prompt_tokens is not None,
                     f"dataset.kind={d.kind} needs dataset.max_prompt_tokens: it is the step layout's prompt "
                     "width (prompts are tokenised on the workers, after the layout is fixed)")

    @property
    def model_shape(self) -> ModelShape:
        """The policy's shape: model.path's config.json when set, else the built-in model section
        (its vocabulary: model.vocab_size, else the addition tokenizer's)."""
        if self.model.path is None:
            return self.model.shape(addition_vocab_size())
        hf = load_hf_config(self.model.path)  # ModelFolderError: one line naming the folder or file
        try:
            return shape_from_hf(hf)
        except ValueError as exc:  # a config.json the shared parser refuses (model_type, sizes)
            raise ConfigError(f"model.path={self.model.path}: config.json: {_first_line(exc)}") from None

    @property
    def reference_parallel(self) -> str:
        """train.reference_parallel resolved: auto is data when tensor_model_parallel_size is 1 and
        the whole model has at most :data:`_WHOLE_REFERENCE_MAX_PARAMS` parameters, else pipeline."""
        t = self.train
        if t.reference_parallel != "auto" or t.tensor_model_parallel_size > 1:
            return resolve_reference_parallel(t, None)
        return resolve_reference_parallel(t, self.model_shape)

    @property
    def layer_split(self) -> tuple[int, ...]:
        """train.layer_split resolved: the listed layers per stage, or for auto the split balancing
        the stages' forward + backward FLOPs, the head (lm_head over the vocabulary) on the last stage,
        at the sequence length prompt width + rollout.max_new_tokens, the head over half the completion
        slots with chunked log-probs (:attr:`logprob_chunk_tokens`): the planner's rule
        (planner/training.py ``estimate_head_layers``, stages/layout ``balanced_layer_split``)."""
        t = self.train
        if t.layer_split != "auto":
            return tuple(t.layer_split)
        # Imported here: planner.loader imports this module.
        from planner.model import ModelShape as PlannerShape
        from planner.training import estimate_head_layers

        shape, new = self.model_shape, self.rollout.max_new_tokens
        head = estimate_head_layers(PlannerShape(**{f.name: getattr(shape, f.name) for f in dataclasses.fields(shape)}),
                                    self.prompt_width + new,
                                    chunked_new_tokens=None if self.logprob_chunk_tokens is None else new)
        return balanced_layer_split(shape.num_hidden_layers,
                                    t.pipeline_model_parallel_size * t.virtual_pipeline_model_parallel_size, head)

    @property
    def engine_dtype(self) -> str:
        """rollout.dtype resolved by the engines' rule (stages/rollout/engine.py ``engine_placement``):
        auto is bfloat16 where they run on CUDA (rollout.device cuda or cuda:N, or auto where this
        process's torch sees a GPU), float32 on the CPU."""
        r = self.rollout
        if r.dtype != "auto" or r.device != "auto":
            return resolve_rollout_dtype(r.dtype, r.device.startswith("cuda"))
        import torch  # here: loading a config needs no torch

        return resolve_rollout_dtype(r.dtype, torch.cuda.is_available())

    @property
    def off_policy(self) -> OffPolicyConfig:
        """The loss's off-policy section (stages/config.py effective_off_policy): train.off_policy when
        set, else decoupled PPO with TIS wherever the behaviour log-probs are not the trainer's own."""
        return effective_off_policy(self.train, self.rollout.max_staleness, self.rollout.engine, self.engine_dtype)

    @property
    def max_model_len(self) -> int:
        """The longest sequence an engine holds: the step's prompt width + rollout.max_new_tokens."""
        return self.prompt_width + self.rollout.max_new_tokens

    @property
    def prompt_width(self) -> int:
        """Token slots of the step layout's prompt column: the addition prompt "<bos>a+b=" (1 + 2 x
        num_digits + 2) for the built-in task, else dataset.max_prompt_tokens (a longer prompt is
        refused or truncated by the prompt source, as dataset.overflow says)."""
        d = self.dataset
        if d.kind == "addition":
            return 1 + 2 * d.num_digits + 2
        return int(d.max_prompt_tokens or 0)

    def _check_parallel_layout(self) -> None:
        """Batch split, tensor split and schedule constraints, each in one line naming the key."""
        t = self.train
        dp, tp = t.data_parallel_size, t.tensor_model_parallel_size
        require(self.task.prompts_per_step % dp == 0,
                 f"train.data_parallel_size={dp} must divide task.prompts_per_step={self.task.prompts_per_step} "
                 "(each data-parallel rank takes whole groups)")
        try:
            self.microbatch_layout  # the token budget holds a sequence; packed rows fit the budget
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
        # The same question the planner asks of a plan (planner/validate.py), in the same words.
        error = parallel_layout_error(self.model_shape, tp=tp, pp=t.pipeline_model_parallel_size,
                                      virtual=t.virtual_pipeline_model_parallel_size, schedule=t.schedule,
                                      num_microbatches=self.num_microbatches)
        require(error is None, error or "")
        if t.layer_split != "auto":
            error = layer_split_error(t.layer_split, self.model_shape.num_hidden_layers,
                                      t.pipeline_model_parallel_size * t.virtual_pipeline_model_parallel_size)
            require(error is None, error or "")
        require(t.reference_parallel != "data" or tp == 1,
                 f"train.reference_parallel=data holds the whole reference on every rank; with "
                 f"train.tensor_model_parallel_size={tp} set train.reference_parallel=pipeline")

    @property
    def num_samples(self) -> int:
        return self.task.prompts_per_step * self.rollout.group_size

    @property
    def length_buckets(self) -> Optional[tuple[int, ...]]:
        """train.length_buckets resolved: auto is stages/train/auto.py ``auto_length_buckets`` of the
        prompt width, rollout.max_new_tokens, the token budget and the model's attention share (None
        with train.pack_row_tokens set); None: every step is one pass shaped for the worst case."""
        t = self.train
        if t.length_buckets != "auto":
            return None if t.length_buckets is None else tuple(t.length_buckets)
        if t.pack_row_tokens is not None:
            return None
        from stages.perf.flops import attention_share  # here: the planner, which it imports, imports this module

        S = self.prompt_width + self.rollout.max_new_tokens
        packed = t.packing is not False  # auto packs with buckets; a 2S row holds two or more sequences packed
        return auto_length_buckets(self.prompt_width, self.rollout.max_new_tokens,
                                   budget=self.token_budget if packed else None,
                                   attention_share=attention_share(self.model_shape, S))

    @property
    def token_budget(self) -> int:
        """B, the token slots of one microbatch: train.max_tokens_per_microbatch, else
        train.micro_batch_size x S (S = prompt width + rollout.max_new_tokens)."""
        t = self.train
        return t.max_tokens_per_microbatch or t.micro_batch_size * (self.prompt_width + self.rollout.max_new_tokens)

    @property
    def packing(self) -> bool:
        """train.packing resolved: auto is on with length buckets (:attr:`length_buckets`) or with
        train.pack_row_tokens, else off."""
        t = self.train
        return auto_packing(self.length_buckets, t.pack_row_tokens) if t.packing == "auto" else bool(t.packing)

    @property
    def lr(self) -> float:
        """train.lr resolved: auto is stages/train/auto.py ``auto_lr``, the pretrained rate with
        model.path, else the built-in model's."""
        lr = self.train.lr
        return auto_lr(pretrained=bool(self.model.path)) if lr == "auto" else float(lr)

    @property
    def logprob_chunk_tokens(self) -> Optional[int]:
        """train.logprob_chunk_tokens resolved: auto is 256 at a vocabulary (:attr:`model_shape`) of
        >= 8,192 tokens, else None (full logits)."""
        chunk = self.train.logprob_chunk_tokens
        return auto_logprob_chunk_tokens(self.model_shape.vocab_size) if chunk == "auto" else chunk

    @property
    def microbatch_layout(self) -> MicrobatchLayout | BucketedLayout:
        """The fixed shape and count of every step's microbatches (stages/train/plan.py):
        budget B = train.max_tokens_per_microbatch or micro_batch_size x S, S = prompt width +
        max_new_tokens; M = the worst case's count, a multiple of data_parallel_size. With length
        buckets (:attr:`length_buckets`): the buckets' shapes, M = the smallest pass
        (stages/train/buckets.py). Packed or padded as :attr:`packing` says."""
        t = self.train
        width, new, budget = self.prompt_width, self.rollout.max_new_tokens, self.token_budget
        buckets, packing = self.length_buckets, self.packing
        if buckets is not None:
            m = microbatches_per_pass(t.schedule, t.pipeline_model_parallel_size,
                                      t.virtual_pipeline_model_parallel_size)
            return bucketed_layout(self.task.prompts_per_step, self.rollout.group_size, width, new, budget,
                                   buckets, packing, m, t.data_parallel_size,
                                   t.max_microbatches_per_pass,
                                   (t.schedule, t.pipeline_model_parallel_size, t.virtual_pipeline_model_parallel_size))
        return microbatch_layout(self.task.prompts_per_step, self.rollout.group_size, width, new, budget,
                                 packing, t.pack_row_tokens, t.data_parallel_size)

    @property
    def num_global_microbatches(self) -> int:
        """Microbatches of the whole global batch (the same every step)."""
        return self.microbatch_layout.num_microbatches

    @property
    def num_microbatches(self) -> int:
        """Microbatches each data-parallel pipeline runs per step."""
        return self.num_global_microbatches // self.train.data_parallel_size


def config_to_dict(cfg: Any) -> dict[str, Any]:
    return dataclasses.asdict(cfg)


def _plain(obj: Any) -> Any:
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return dataclasses.asdict(obj)
    return str(obj)


def config_hash(cfg: Any) -> str:
    """A short stable digest of a config (or a dict of config parts), recorded beside every stored
    artifact."""
    blob = json.dumps(_plain(cfg) if dataclasses.is_dataclass(cfg) else cfg, sort_keys=True,
                      default=_plain).encode()
    return hashlib.sha256(blob).hexdigest()[:16]


def load_config(path: str | Path | None = None, overrides: list[str] | tuple[str, ...] = (),
                base: dict | None = None) -> GRPOConfig:
    """The frozen config of a run (the YAML at ``path``, or ``base``: a config as run.json stores
    it), with ``overrides``. Raises :class:`ConfigError` with one line naming the bad key."""
    schema = OmegaConf.structured(GRPOConfig)
    layers = [schema]
    if base is not None:
        layers.append(OmegaConf.create(base))
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise ConfigError(f"config file {path} does not exist")
        try:
            layers.append(OmegaConf.load(path))
        except Exception as exc:  # yaml.YAMLError and friends
            raise ConfigError(f"{path}: not valid YAML: {_first_line(exc)}") from exc
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override {item!r} must look like key=value")
        try:
            layers.append(OmegaConf.from_dotlist([item]))
        except Exception as exc:  # a value that is not valid YAML: yaml.YAMLError and friends
            why = getattr(exc, "problem", None) or _first_line(exc)  # yaml's MarkedYAMLError says what it missed
            raise ConfigError(f"override {item!r}: not valid YAML: {why}") from None
    try:
        merged = OmegaConf.merge(*layers)
        cfg = OmegaConf.to_object(merged)
    except ConfigError:
        raise
    except (DatasetError, ModelFolderError) as exc:  # the dataset section's checks; an unreadable model.path
        raise ConfigError(_first_line(exc)) from None
    except OmegaConfBaseException as exc:
        key = getattr(exc, "full_key", None)
        where = f"{key}: " if key else ""
        raise ConfigError(f"{where}{_first_line(exc)}") from exc
    assert isinstance(cfg, GRPOConfig)
    return cfg


def load_run_folder_config(run_dir: str | Path, overrides: list[str] | tuple[str, ...] = ()) -> GRPOConfig:
    """The config a run folder (``runs/<run_name>``) was run with, from its run.json, with
    ``overrides``; runs_dir and run_name are where the folder is now (it may have been moved).
    Raises :class:`ConfigError` in one line when the folder holds no run.json with a config."""
    from storage.run_folder import RunFolder

    target = Path(run_dir).resolve()
    state = RunFolder.at(target.parent, target.name).load_run_state() if target.is_dir() else None
    if state is None or not isinstance(state.get("config"), dict):
        raise ConfigError(f"{target} holds no run.json with a config: give a run folder (runs/<run_name>)")
    return load_config(None, [*overrides, f"runs_dir={target.parent}", f"run_name={target.name}"],
                       base=state["config"])
