"""One training rank of a (pp, dp, tp) mesh: its pipeline stages of the policy, frozen reference
stages, the schedules and the optimiser, kept alive across iterations.

The engine is plain torch: flows/ places one per Dask worker (``train`` resource) and calls
:meth:`TrainRank.train_step` / :meth:`TrainRank.reference_logp` once per iteration on every rank.
Gradients are exact, i.e. equal to the single-process full-batch gradient, whatever the layout:

- every microbatch loss is a partial sum weighted by global-batch denominators
  (stages/train/loss.py, batch.py), and no schedule rescales it (``scale_grads=False``);
- data-parallel ranks take contiguous blocks of whole microbatches and their gradients are
  SUMMED (stages/train/parallel.py);
- a tied embedding lives on the first and the last stage; both copies get the sum of the two
  gradients, so they take the same update;
- the clip norm counts every weight once: TP shards once each, replicated weights on TP rank 0,
  one DP replica, one copy of a tied embedding.

A step may be several pipeline passes (length buckets, stages/train/buckets.py): each pass shape
[m microbatches of rows x T] gets its own stages and schedule, built at its first use and cached
(the modules are shared), so no schedule ever sees a new shape; the passes' gradients accumulate
before the one optimiser step, exact since every loss weight is global. torch infers a new
schedule's tensor shapes by running one microbatch forward and backward through every stage; a
pass whose microbatch shape an earlier schedule already ran (the same bucket, another m) gives
its stages those shapes instead (:meth:`TrainRank._known_shapes`), so only a bucket's first
schedule pays for the inference.

Every distributed wait is bounded by ``timeout_s``; a failing rank or disagreeing inputs end the
call on every rank with an error naming the rank and the cause (stages/train/faults.py).

Devices. A rank computes on the CPU or on a GPU of its own (``TrainSetup.device``, resolved by
:func:`train_placement`): its modules, optimiser state and each pass's inputs live there, the
process groups pair gloo for host tensors with NCCL for CUDA ones, and what leaves the rank
(log-probs, weights, optimiser state) is copied to the host. ``TrainSetup.dtype`` bfloat16 runs
every stage's forward under ``torch.autocast`` (float32 weights, gradients and optimiser state).
"""

from __future__ import annotations

import math
import os
import time
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Optional

import numpy as np
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from stages.config import TRAIN_DEVICES, TRAIN_DTYPES
from stages.layout import layer_split_error
from stages.policy import DecoderConfig, build_stage, hf_named_parameters, load_hf_state, stage_hf_names
from stages.train.batch import BucketedBatch
from stages.train.faults import (InjectedFault, InputMismatchError, NonFiniteGradientError, StepGuard,
                                 TrainInputError, TrainStepError, passes_signature, signature_of)
from stages.train.fill import FillPlan, StepFill, WaitRecord, decode_offers, encode_offers, offer, plan_fill
from stages.layout import ParallelLayout, schedule_error
from stages.train.loss import TARGET_FIELDS, LossConfig, LossStats, grpo_microbatch_loss, make_chunked_loss
from stages.train.groups import init_rank_groups
from stages.train.parallel import (DEFAULT_BUCKET_BYTES, allreduce_grads, apply_tensor_parallel, clip_grad_norm,
                                   head_local_parameters, local_tensor, sum_tied_grads, unique_parameters)
from stages.train.schedules import ForwardOnlySchedule, LogpStage, build_train_schedule
from stages.train.timeline import Action, RankTimeline, TimedStage, autocast_to, bubble_fraction, timed_p2p

__all__ = ["TrainSetup", "StepResult", "TrainRank", "rank_tensor_names", "train_placement", "cuda_layout_error",
           "TrainStepError", "InputMismatchError", "InjectedFault"]

_CPU = torch.device("cpu")
_AUTOCAST = {"float32": None, "bfloat16": torch.bfloat16}  # train.dtype -> the autocast dtype of the forwards
_LOGP_TO = ("output", "loss")  # the ranks a forward-only pass's log-probs go to (TrainRank.batch_logp)


def _fused_adamw(params: list[nn.Parameter]) -> Optional[bool]:
    """AdamW's fused kernel (one pass over each tensor instead of a dozen foreach ops: a fifth
    of the time on a CPU, docs/performance.md) for plain CPU or CUDA tensors; None (torch's
    default, foreach) for tensor-parallel DTensors. Its update differs from foreach's in the last bit."""
    return True if params and all(not isinstance(p, DTensor) and p.device.type in ("cpu", "cuda")
                                  for p in params) else None


def train_placement(device: str, dtype: str, rank: int, world_size: int
                    ) -> tuple[torch.device, Optional[torch.dtype]]:
    """Rank ``rank``'s device and autocast dtype. ``device``: cpu; cuda, a GPU per rank (rank r on
    GPU r mod the count, one machine's ranks on its own GPUs: NCCL does not share one between
    ranks); auto, cuda when torch sees at least ``world_size`` GPUs, else cpu. ``dtype``: float32,
    or bfloat16 (autocast forwards)."""
    if device not in TRAIN_DEVICES:
        raise ValueError(f"train.device={device!r} must be one of {', '.join(TRAIN_DEVICES)}")
    if dtype not in TRAIN_DTYPES:
        raise ValueError(f"train.dtype={dtype!r} must be one of {', '.join(TRAIN_DTYPES)}")
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if device == "auto":
        device = "cuda" if count >= world_size else "cpu"
    if device == "cpu":
        return _CPU, _AUTOCAST[dtype]
    if count == 0:
        raise ValueError(f"train.device=cuda but torch {torch.__version__} sees no CUDA device; use train.device=cpu")
    if count < world_size:
        raise ValueError(f"train.device=cuda needs a GPU per training rank: {world_size} ranks, torch sees {count}")
    return torch.device("cuda", rank % count), _AUTOCAST[dtype]


def cuda_layout_error(schedule: str, virtual_stages: int) -> Optional[str]:
    """Why a layout cannot train on CUDA, or None. The forward-only passes send a looped rank's
    every microbatch of one stage before receiving for its next: gloo buffers that, NCCL's ordered
    point-to-point streams can deadlock on it, so looped virtual stages stay on the CPU."""
    if virtual_stages > 1 and schedule not in ("zbv", "dualpipev"):
        return (f"train.schedule={schedule} with virtual_pipeline_model_parallel_size={virtual_stages} does not run "
                "on train.device=cuda (the forward-only passes' send order can deadlock NCCL); use one stage per "
                "rank, a V-shaped schedule (zbv, dualpipev) or train.device=cpu")
    return None


@dataclass(frozen=True)
class TrainSetup:
    """Everything a training rank needs besides its weights; the same on every rank."""

    model: DecoderConfig
    pipeline_parallel_size: int
    num_microbatches: int
    """Microbatches per data-parallel rank and step."""
    schedule: str = "1f1b"
    virtual_stages: int = 1
    """Stages per pipeline rank (train.virtual_pipeline_model_parallel_size)."""
    data_parallel_size: int = 1
    tensor_parallel_size: int = 1
    lr: float = 1e-3
    weight_decay: float = 0.0
    max_grad_norm: float = 1.0
    loss: LossConfig = field(default_factory=LossConfig)
    logprob_chunk_tokens: Optional[int] = None
    """Set: the last stage returns hidden states and the loss applies the head in chunks of this
    many tokens (stages/train/loss.py); None: the last stage returns logits."""
    timeout_s: float = 120.0
    grad_bucket_bytes: int = DEFAULT_BUCKET_BYTES
    faults: tuple[InjectedFault, ...] = ()
    """Test-only fault injection (stages/train/faults.py)."""
    reference_parallel: str = "pipeline"
    """How the ranks run the frozen reference (train.reference_parallel, resolved): split into the
    pipeline's stages like the policy, or whole on every rank, each taking a share of the microbatches."""
    reference: bool = True
    """Whether the ranks hold the frozen reference at all (train.uses_reference): False when the
    loss never reads its log-probs (kl_beta 0), so no copy of it is built."""
    device: str = "cpu"
    """Where each rank computes (train.device, :func:`train_placement`)."""
    dtype: str = "float32"
    """float32, or bfloat16: every forward under autocast (train.dtype)."""
    layer_split: Optional[tuple[int, ...]] = None
    """Decoder layers of each of the p * v stages, policy and pipelined reference alike
    (train.layer_split, resolved: GRPOConfig.layer_split); None: the even split."""
    reference_fill: bool = False
    """Whether :meth:`TrainRank.train_step_with_reference` computes some of the reference's
    microbatches inside the step's P2P waits (train.reference_fill, stages/train/fill.py).
    Takes effect with the reference whole on every rank (reference_parallel=data), on the CPU
    (gloo), with two or more pipeline ranks; the log-probs are the same bits either way."""

    def __post_init__(self) -> None:
        error = schedule_error(self.schedule, self.pipeline_parallel_size, self.num_microbatches,
                               self.virtual_stages, self.model.num_hidden_layers)
        if error is None and self.layer_split is not None:
            error = layer_split_error(self.layer_split, self.model.num_hidden_layers,
                                      self.pipeline_parallel_size * self.virtual_stages)
        if error:
            raise ValueError(error)
        if self.reference_parallel not in ("pipeline", "data"):  # resolved: GRPOConfig.reference_parallel
            raise ValueError(f"reference_parallel={self.reference_parallel!r} is not one of pipeline, data")
        if self.reference_parallel == "data" and self.tensor_parallel_size > 1:
            raise ValueError(f"reference_parallel=data holds the whole reference on every rank; with "
                             f"tensor_parallel_size={self.tensor_parallel_size} use pipeline")
        _ = self.layout  # validates the sizes
        if self.device not in TRAIN_DEVICES or self.dtype not in TRAIN_DTYPES:
            train_placement(self.device, self.dtype, 0, 1)  # raises, naming the key

    @property
    def layout(self) -> ParallelLayout:
        return ParallelLayout(self.pipeline_parallel_size, self.data_parallel_size, self.tensor_parallel_size,
                              self.virtual_stages, self.schedule)


@dataclass(frozen=True)
class StepResult:
    """What one rank measured in one call: loss metrics (ranks holding the last stage), grad_norm
    and lr (train_step), bubble_fraction, step_seconds, activation_bytes_per_microbatch_stage{i} and
    peak_inflight_stage{i}, train_passes and train_token_slots_per_real_token (training calls;
    stages/train/buckets.py), pipeline_shape_inferences (schedules whose first step this was and
    whose shapes torch inferred); its actions; the step window (time.time_ns). A data-parallel
    reference pass records no actions, and its bubble_fraction is the rank's time outside its own
    microbatches (the input check and the wait in the reduction)."""

    rank: int
    metrics: dict[str, float]
    actions: list[Action]
    window_ns: tuple[int, int]


class TrainRank:
    def __init__(self, setup: TrainSetup, rank: int, init_method: str, tensors: dict[str, torch.Tensor],
                 reference_tensors: Optional[dict[str, torch.Tensor]] = None):
        self.setup, self.rank, self.layout = setup, rank, setup.layout
        self.device, self.autocast = train_placement(setup.device, setup.dtype, rank, self.layout.world_size)
        if self.device.type == "cuda":
            error = cuda_layout_error(setup.schedule, setup.virtual_stages)
            if error:
                raise ValueError(error)
            torch.cuda.set_device(self.device)  # NCCL binds the rank to the current device
            # A blocking wait raises at train.timeout_s like gloo's, so a stuck peer fails the step
            # on every rank (stages/train/faults.py) instead of NCCL's watchdog ending the process.
            os.environ.setdefault("TORCH_NCCL_BLOCKING_WAIT", "1")
        self.groups = init_rank_groups(self.layout, rank, init_method, timedelta(seconds=setup.timeout_s),
                                       setup.model.tie_word_embeddings, self.device.type)
        self.coord = self.groups.coord
        c = self.coord
        self.guard = StepGuard(self.groups.store, rank, self.layout.world_size,
                               f"rank {rank} (pp={c.pp}, dp={c.dp}, tp={c.tp})")
        self.stage_ids = self.layout.stages_of(c.pp)
        self.output_rank = self.layout.output_rank
        self.modules = [self._build(s, tensors) for s in self.stage_ids]
        # The frozen reference is the run's (policy v0), not the version a resumed run starts from.
        ref_tensors = tensors if reference_tensors is None else reference_tensors
        # reference_parallel=data: the whole frozen reference on this rank, a share of each
        # forward-only pass's microbatches; pipeline: its stages beside the policy's.
        self.reference_whole: Optional[LogpStage] = None
        self.reference: list[nn.Module] = []
        if not setup.reference:
            pass  # kl_beta 0: nothing reads the reference's log-probs
        elif setup.reference_parallel == "data":
            self.reference_whole = LogpStage(self._whole(ref_tensors), setup.loss.temperature,
                                             setup.logprob_chunk_tokens)
        else:
            self.reference = [self._build(s, ref_tensors, frozen=True) for s in self.stage_ids]
        self.timeline, self.forward_timeline = RankTimeline(), RankTimeline()
        self._stats: list[LossStats] = []
        self.stages = [self._stage(m, s, self.timeline) for m, s in zip(self.modules, self.stage_ids)]
        self.schedule = build_train_schedule(setup.schedule, self.stages, setup.num_microbatches, self._loss_fn())
        self.prox_schedule = self._forward_only(self.modules, setup.num_microbatches)
        # pass key -> schedule: the run's fixed layout under "train" / "reference_logp" / ...,
        # each length bucket's shape under its own key (built at first use, the same on every rank)
        self._schedules: dict[str, object] = {"train": self.schedule, "proximal_logp": self.prox_schedule}
        if self.reference:
            self._schedules["reference_logp"] = self._forward_only(self.reference, setup.num_microbatches)
        self._inference_pending: set[str] = set(self._schedules)  # schedules whose first step infers shapes
        self.params = unique_parameters(self.modules)
        self.head_local = head_local_parameters(self.modules)  # TP sums their per-head gradient shares
        self.optimizer = torch.optim.AdamW(self.params, lr=setup.lr, weight_decay=setup.weight_decay,
                                           fused=_fused_adamw(self.params))
        self._passes = 0  # training / forward-only passes started: the same sequence on every rank
        self._pass = -1  # the one running (InjectedFault.step, the failure reports' key)
        self.last_forward: Optional[StepResult] = None
        self._shapes: dict[str, dict[str, str]] = {}  # schedule -> input signature of its first step
        # (pass kind, one microbatch's input_ids shape) -> the stages of each schedule built for it
        self._stages_by_shape: dict[tuple, list[list[TimedStage]]] = {}
        # reference_fill: each train pass's P2P waits in its last step (by schedule key), the
        # time of one whole-reference microbatch (by its shape), and the fill of the running step
        self.fills_waits = (setup.reference_fill and self.reference_whole is not None and self.device.type == "cpu"
                            and self.layout.pp > 1)
        self._fill_waits: dict[str, list[WaitRecord]] = {}
        self._reference_mb_ns: dict[tuple[int, int], float] = {}
        self._fill: Optional[StepFill] = None
        self._fill_measured: dict[str, float] = {}

    # -- construction -------------------------------------------------------------------------------
    def _build(self, stage: int, tensors: dict[str, torch.Tensor], frozen: bool = False) -> nn.Module:
        module = build_stage(self.setup.model, stage, self.layout.num_stages,
                             return_hidden=self.setup.logprob_chunk_tokens is not None,
                             layer_split=self.setup.layer_split)
        load_hf_state(module, tensors)
        module.to(self.device)
        if frozen:
            module.requires_grad_(False)
        if self.groups.tp_mesh is not None:
            apply_tensor_parallel(module, self.groups.tp_mesh)
        return module

    def _whole(self, tensors: dict[str, torch.Tensor]) -> nn.Module:
        """The whole model, frozen, from HF-named ``tensors`` (every layer's)."""
        module = build_stage(self.setup.model, return_hidden=self.setup.logprob_chunk_tokens is not None)
        names = stage_hf_names(module)
        missing = sorted(set(names) - set(tensors))
        if missing:
            raise ValueError(f"reference_parallel=data holds the whole reference on every rank; {len(missing)} "
                             f"of its tensors were not given, e.g. {missing[0]}")
        load_hf_state(module, {k: tensors[k] for k in names})
        return module.to(self.device).requires_grad_(False).eval()

    def _stage(self, module: nn.Module, index: int, timeline: RankTimeline,
               example: Optional[tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]]] = None) -> TimedStage:
        """``example``: (input args, outputs) of one microbatch, meta tensors of its shapes: torch then
        skips its shape inference (None: it runs one microbatch through the stage at the first step)."""
        inputs, outputs = example or (None, None)
        return TimedStage(module, index, self.layout.num_stages, self.device, input_args=inputs, output_args=outputs,
                          group=self.groups.pp, timeline=timeline, before_forward=self._before_forward,
                          autocast=self.autocast)

    def _forward_only(self, modules: list[nn.Module], num_microbatches: int) -> ForwardOnlySchedule:
        return ForwardOnlySchedule(self._logp_stages(modules), num_microbatches, self.layout.stage_to_rank())

    def _logp_stages(self, modules: list[nn.Module], examples: Optional[list] = None) -> list[TimedStage]:
        chunk = self.setup.logprob_chunk_tokens
        return [self._stage(LogpStage(m, self.setup.loss.temperature, chunk), s, self.forward_timeline, example)
                for m, s, example in zip(modules, self.stage_ids, examples or [None] * len(modules))]

    def _schedule_for(self, what: str, key: str, m: int, rows_shape: tuple[int, ...]):
        """The cached schedule of pass ``key`` (built at its first use: new stages over the same
        modules). ``rows_shape``: this rank's input_ids of the pass, [m x rows, T]."""
        if key not in self._schedules:
            shape = (what, rows_shape[0] // m, *rows_shape[1:])  # one microbatch's input_ids, per kind of pass
            examples = self._known_shapes(shape) or [None] * len(self.stage_ids)
            if what == "train":
                stages = [self._stage(mod, s, self.timeline, example)
                          for mod, s, example in zip(self.modules, self.stage_ids, examples)]
                self._schedules[key] = build_train_schedule(self.setup.schedule, stages, m, self._loss_fn())
            else:
                stages = self._logp_stages(self.reference if what == "reference_logp" else self.modules, examples)
                self._schedules[key] = ForwardOnlySchedule(stages, m, self.layout.stage_to_rank())
            self._stages_by_shape.setdefault(shape, []).append(stages)
            if examples[0] is None:
                self._inference_pending.add(key)
        return self._schedules[key]

    def _first_use(self, key: str) -> int:
        """1 when pass ``key``'s schedule runs for the first time and torch infers its shapes, else 0
        (the metric pipeline_shape_inferences: each one is a microbatch's forward and backward more)."""
        if key not in self._inference_pending:
            return 0
        self._inference_pending.remove(key)
        return 1

    def _known_shapes(self, shape: tuple) -> Optional[list[tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]]]]:
        """Per stage of this rank, (inputs, outputs) as meta tensors of the shapes, strides, dtypes
        and requires_grad that torch inferred for an earlier schedule of microbatches ``shape``;
        None before one has run, or where they hold DTensors (tensor parallelism: those need
        gradient placements too, left to torch's inference). Every rank runs the same passes, so
        every stage votes the same way (torch's static/dynamic vote would fall back to inference
        together otherwise)."""
        def example(meta) -> torch.Tensor:
            t = torch.empty_strided(meta.shape, meta.stride, dtype=meta.dtype, device="meta")
            return t.requires_grad_(meta.requires_grad) if meta.requires_grad else t

        for stages in self._stages_by_shape.get(shape, ()):
            metas = [getattr(stage, "_stage_meta", None) for stage in stages]
            if all(m is not None and m.is_complete_for_forward() and not m.has_dtensors() for m in metas):
                return [(tuple(map(example, m.inputs)), tuple(map(example, m.outputs))) for m in metas]
        return None

    def _loss_fn(self):
        """loss_fn(output, target) of the last stage; each microbatch's LossStats go to _stats."""
        cfg, chunk = self.setup.loss, self.setup.logprob_chunk_tokens
        if chunk is not None and self.holds_last:
            return make_chunked_loss(self.modules[-1].lm_head, cfg, chunk, on_stats=self._stats.append)

        def loss_fn(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
            loss, stats = grpo_microbatch_loss(output, target, cfg)
            self._stats.append(stats)
            return loss

        return loss_fn

    @property
    def holds_first(self) -> bool:
        return 0 in self.stage_ids

    @property
    def holds_last(self) -> bool:
        return self.layout.num_stages - 1 in self.stage_ids

    @property
    def is_output_rank(self) -> bool:
        """The rank whose forward-only passes return the gathered log-probs."""
        return self.rank == self.output_rank

    def _now_ns(self) -> int:
        """time.time_ns() once this rank's device has finished the work queued so far (CUDA runs
        asynchronously: without the wait a window measures kernel launches)."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.time_ns()

    # -- inputs -------------------------------------------------------------------------------------
    def _before_forward(self, stage: int, microbatch: int) -> None:
        self._inject(stage, microbatch)
        if self._fill is not None:
            self._fill.before_forward(stage, microbatch)

    def _inject(self, stage: int, microbatch: int) -> None:
        for f in self.setup.faults:
            if (f.rank, f.step, f.microbatch) == (self.rank, self._pass, microbatch) and stage == self.stage_ids[0]:
                if f.kind == "raise":
                    raise RuntimeError(f"injected fault: rank {self.rank} fails in the forward of microbatch "
                                       f"{microbatch}")
                if f.kind == "stall":
                    time.sleep(f.seconds)

    def _pass_inputs(self, call: int, what: str, passes: list[tuple[Optional[int], dict[str, torch.Tensor]]]
                     ) -> list[tuple[str, int, dict[str, torch.Tensor]]]:
        """Check that every rank holds the same passes (count, each one's microbatches and shapes),
        each shaped as in its schedule's first step; then take this rank's data-parallel block of
        whole microbatches of each (rows [d R / D, (d + 1) R / D)). Returns (schedule key, m per
        data-parallel rank, local inputs) per pass. ``passes``: (global microbatches or None for the
        run's fixed count, full inputs)."""
        D = self.layout.dp
        passes = self._faulty_inputs(passes)
        ms = [self.setup.num_microbatches if mb is None else mb // D for mb, _ in passes]
        signature, sigs = passes_signature([(m, full) for m, (_, full) in zip(ms, passes)])
        prepared = [(mb, m, full, sig) for (mb, full), m, sig in zip(passes, ms, sigs)]
        self.guard.check_inputs(call, signature)
        out = []
        for global_mb, m, full, sig in prepared:
            rows = int(full["input_ids"].shape[0])
            if global_mb is not None and (global_mb % D or schedule_error(self.setup.schedule, self.layout.pp, m,
                                                                           self.layout.virtual)):
                raise TrainInputError(f"a pass of {global_mb} microbatches over data_parallel_size {D} does not "
                                      f"run on train.schedule={self.setup.schedule}: plan the buckets with "
                                      "buckets.valid_microbatches")
            if rows % (D * m):
                raise TrainInputError(f"the batch has {rows} rows, which do not split into data_parallel_size x "
                                      f"microbatches = {D} x {m} equal microbatches: change train.micro_batch_size")
            # input_ids fixes the activations sent between stages; keyword tensors stay on each rank.
            shape = {k: sig[k] for k in ("num_microbatches", "input_ids")}
            key = _pass_key(what, global_mb, m, sig["input_ids"])
            first = self._shapes.setdefault(key, shape)
            if shape != first:  # the same on every rank: they agree on the signature
                changed = [f"{k} {first[k]} -> {shape[k]}" for k in shape if first[k] != shape[k]]
                raise TrainInputError(f"{what}: a pipeline's shapes are fixed by its first step, and "
                                      f"{', '.join(changed)}; keep the run's microbatch layout fixed")
            per = rows // D
            lo = self.coord.dp * per
            out.append((key, m, {k: v[lo:lo + per].to(self.device) for k, v in full.items()}))
        return out

    def _faulty_inputs(self, passes: list) -> list:
        """Test-only input faults (InjectedFault kinds shape and passes) of this rank's current pass."""
        kinds = {f.kind for f in self.setup.faults if (f.rank, f.step) == (self.rank, self._pass)}
        if "shape" in kinds:
            mb, full = passes[0]
            passes = [(mb, {k: v[:-1] for k, v in full.items()}), *passes[1:]]
        return passes[:-1] if "passes" in kinds and len(passes) > 1 else passes

    def _begin(self, what: str):
        """Number the next pass (train or forward-only) and guard it."""
        self._pass = self._passes
        self._passes += 1
        return self._pass, self.guard.guarded(str(self._pass), what)

    # -- one optimiser step -------------------------------------------------------------------------
    def train_step(self, batch) -> StepResult:
        """Run the schedule over the global batch and take one optimiser step."""
        call, guarded = self._begin("train_step")
        with guarded:
            result = self._forward_backward(call, batch)
            norm = self._clip_grads()
            if not math.isfinite(norm):
                self._refuse_non_finite(norm)
            self.optimizer.step()
        metrics = {**result.metrics, "grad_norm": norm, "lr": self.optimizer.param_groups[0]["lr"]}
        return StepResult(result.rank, metrics, result.actions, result.window_ns)

    def set_lr(self, lr: float) -> None:
        """The rate of the next optimiser steps, on every parameter group (the run sets each step's:
        stages/train/schedule.py ``lr_at``)."""
        for group in self.optimizer.param_groups:
            group["lr"] = lr

    def _refuse_non_finite(self, norm: float) -> None:
        """Every rank sees the same all-reduced norm, so every rank is here: gather where the
        non-finite gradients are and raise the same one-line error on each, before any weight moves."""
        mine = next((name for name, p in self._named_params()
                     if p.grad is not None and not bool(torch.isfinite(local_tensor(p.grad)).all())), None)
        found: list = [None] * self.layout.world_size
        dist.all_gather_object(found, mine)
        where = "; ".join(f"rank {r}: {name}" for r, name in enumerate(found) if name) or "none found per rank"
        raise NonFiniteGradientError(
            f"the gradient norm is {norm}: non-finite gradients ({where}); no optimiser step was taken and "
            "nothing is published. Check train.lr and the model folder's weights for NaN or inf")

    def forward_backward(self, batch) -> StepResult:
        """Gradients of the global-batch loss in ``.grad`` of this rank's parameters."""
        call, guarded = self._begin("forward_backward")
        with guarded:
            return self._forward_backward(call, batch)

    def _forward_backward(self, call: int, batch) -> StepResult:
        passes = getattr(batch, "passes", (batch,))
        inputs = [(getattr(p, "num_microbatches", None),
                   {"input_ids": p.input_ids, "target": p.target, **getattr(p, "stage_kwargs", lambda: {})()})
                  for p in passes]
        # The input check is a collective: every rank leaves it together, the common start that
        # makes every rank's window measure the same step (no barrier of its own: each collective
        # is one more wait for the rank a busy host scheduled last).
        local_passes = self._pass_inputs(call, "train", inputs)
        self.optimizer.zero_grad(set_to_none=True)
        self.timeline.clear()
        stats: list[LossStats] = []
        inferences = 0
        t0 = self._now_ns()
        fill = self._fill
        if fill is not None:
            fill.begin_step([local["target"] if self.holds_last else None for _, _, local in local_passes])
        for i, (key, m, local) in enumerate(local_passes):  # gradients accumulate over the passes
            schedule = self._schedule_for("train", key, m, tuple(local["input_ids"].shape))
            first = self._first_use(key)
            inferences += first
            input_ids, target = local.pop("input_ids"), local.pop("target")
            args = (input_ids,) if self.holds_first else ()
            self._stats.clear()
            if fill is not None:
                fill.begin_pass(i)
            with timed_p2p(fill):
                schedule.step(*args, target=target if self.holds_last else None, return_outputs=False, **local)
            # A schedule's first step runs the loss once more for shape inference: keep the real ones.
            stats += self._stats[-m:] if self.holds_last else []
            if fill is not None:
                waits = fill.end_pass()
                if not first:  # a first step's waits include torch's shape inference
                    self._fill_waits[key] = waits
        if fill is not None:
            fill.end_step()
        t1 = self._now_ns()
        allreduce_grads(self.params, self.groups.dp, self.setup.grad_bucket_bytes)
        if self.head_local:
            allreduce_grads(self.head_local, self.groups.tp, self.setup.grad_bucket_bytes)
        self._sum_tied_grads()
        metrics = self._loss_metrics(stats)
        metrics["bubble_fraction"] = bubble_fraction(self.timeline.actions, t0, t1)
        metrics["step_seconds"] = (t1 - t0) / 1e9
        metrics["train_passes"] = float(len(passes))
        metrics["pipeline_shape_inferences"] = float(inferences)
        if getattr(batch, "slots_per_real_token", None) is not None:
            metrics["train_token_slots_per_real_token"] = float(batch.slots_per_real_token)
        metrics.update(self.timeline.stash_metrics(), **self.timeline.p2p_metrics())
        return StepResult(self.rank, metrics, list(self.timeline.actions), (t0, t1))

    def _loss_metrics(self, stats: list[LossStats]) -> dict[str, float]:
        """Loss metrics of the global batch (LossStats.metrics), on ranks holding the last stage."""
        if not self.holds_last:
            return {}
        total = LossStats()
        for s in stats:
            total.add(s)
        sums = torch.tensor(total.sums(), dtype=torch.float64)
        peak = torch.tensor([total.is_weight_max], dtype=torch.float64)
        if self.layout.dp > 1:
            dist.all_reduce(sums, group=self.groups.dp)
            dist.all_reduce(peak, op=dist.ReduceOp.MAX, group=self.groups.dp)
        metrics = LossStats(*sums.tolist(), float(peak)).metrics()
        if not self.setup.reference:
            del metrics["kl"]  # ref_logp holds zeros: there is no KL to the reference to report
        return metrics

    def _tied_weights(self) -> list[nn.Parameter]:
        """This rank's copies of a tied embedding (one Parameter when a single stage holds both)."""
        if not self.setup.model.tie_word_embeddings:
            return []
        out = []
        if self.holds_first:
            out.append(self.modules[0].embed_tokens.weight)
        if self.holds_last and all(self.modules[-1].lm_head.weight is not w for w in out):
            out.append(self.modules[-1].lm_head.weight)
        return out

    def _sum_tied_grads(self) -> None:
        sum_tied_grads(self._tied_weights(), self.groups.tied)

    def _clip_grads(self) -> float:
        """Clip by the global norm over every weight of the model, each counted once: one DP
        replica, TP shards on every TP rank but replicated weights on TP rank 0 only, and the
        first stage's copy of a tied embedding."""
        tied = self._tied_weights()
        duplicate = {id(tied[-1])} if len(tied) == 2 or (tied and not self.holds_first) else set()
        c = self.coord

        def counted(p: nn.Parameter) -> bool:
            return c.dp == 0 and id(p) not in duplicate and (isinstance(p, DTensor) or c.tp == 0)

        return clip_grad_norm(self.params, self.setup.max_grad_norm, counted)

    # -- forward-only passes ------------------------------------------------------------------------
    def reference_logp(self, input_ids: torch.Tensor, next_ids: torch.Tensor,
                       stage_kwargs: Optional[dict[str, torch.Tensor]] = None) -> Optional[torch.Tensor]:
        """Per-token log-probs [rows, T] of the frozen reference, on :attr:`is_output_rank`; None elsewhere."""
        out = self._forward_logp("reference_logp", [(None, input_ids, next_ids, stage_kwargs or {})])
        return None if out is None else out[0]

    def proximal_logp(self, input_ids: torch.Tensor, next_ids: torch.Tensor,
                      stage_kwargs: Optional[dict[str, torch.Tensor]] = None) -> Optional[torch.Tensor]:
        """Per-token log-probs [rows, T] of the current (trainable) weights, no gradients kept."""
        out = self._forward_logp("proximal_logp", [(None, input_ids, next_ids, stage_kwargs or {})])
        return None if out is None else out[0]

    def batch_logp(self, batch, what: str = "reference_logp", to: str = "output") -> Optional[np.ndarray]:
        """Per completion token log-probs [N, max_new_tokens] in store order of a step's batch (every
        pass of a bucketed one) under the reference (``reference_logp``) or the current weights
        (``proximal_logp``). ``to``: "output", on :attr:`is_output_rank` only; "loss", on every rank
        holding the last stage (the ranks computing the loss). None elsewhere."""
        if what not in ("reference_logp", "proximal_logp"):
            raise ValueError(f"what={what!r} must be reference_logp or proximal_logp")
        if what == "reference_logp" and not self.setup.reference:
            raise ValueError("this rank holds no reference (TrainSetup.reference is False: kl_beta 0)")
        if to not in _LOGP_TO:
            raise ValueError(f"to={to!r} must be one of {', '.join(_LOGP_TO)}")
        passes = getattr(batch, "passes", (batch,))
        outs = self._forward_logp(what, [(getattr(p, "num_microbatches", None), p.input_ids,
                                          p.target[..., 0].long(), p.stage_kwargs()) for p in passes], to)
        if outs is None:
            return None
        return batch.completion_values(outs if isinstance(batch, BucketedBatch) else outs[0])

    def train_step_with_reference(self, batch) -> tuple[StepResult, Optional[np.ndarray]]:
        """The frozen reference's forward-only pass over the step's own batch, its log-probs put in
        the target's ref_logp channel on the ranks computing the loss, then :meth:`train_step`: the
        step a separate reference pass, its log-probs stored and the batch rebuilt from the store
        would give, bit for bit (the same values in the same channel), in one call. Returns the step
        (its metrics with ``reference_seconds``, the pass's wall time on this rank) and, on
        :attr:`is_output_rank`, the log-probs [N, max_new_tokens] in store order to store."""
        if self.fills_waits:
            return self._train_step_with_filled_reference(batch)
        t0 = time.perf_counter()
        logp = self.batch_logp(batch, "reference_logp", to="loss")
        reference_s = time.perf_counter() - t0
        if logp is not None:
            batch = batch.with_completion_values("ref_logp", logp)
        step = self.train_step(batch)
        step.metrics["reference_seconds"] = reference_s
        return step, logp if self.is_output_rank else None

    def _train_step_with_filled_reference(self, batch) -> tuple[StepResult, Optional[np.ndarray]]:
        """:meth:`train_step_with_reference` with some reference microbatches computed inside the
        step's P2P waits (TrainSetup.reference_fill, stages/train/fill.py); the same log-probs
        in the same target channel, so the same step bit for bit. Its metrics add
        ``reference_fill_microbatches`` and ``reference_fill_seconds`` (this rank's fills), and what
        its plan went on: ``reference_fill_wait_seconds`` (the longest wait this rank offered, 0 for
        none) and ``reference_microbatch_seconds`` (its time for one reference microbatch, the
        slowest shape of the step, as last measured)."""
        passes = getattr(batch, "passes", (batch,))
        D = self.layout.dp
        specs = [(getattr(p, "num_microbatches", None), p.input_ids, p.target[..., 0].long(), p.stage_kwargs())
                 for p in passes]
        keys = [_pass_key("train", mb, mb // D if mb is not None else self.setup.num_microbatches,
                          signature_of(0, {"input_ids": ids})["input_ids"]) for mb, ids, *_ in specs]
        t0 = time.perf_counter()
        outs, plan = self._shared_logp("reference_logp", specs, to="loss", fill_keys=keys)
        reference_s = time.perf_counter() - t0
        bucketed = isinstance(batch, BucketedBatch)
        values = None if outs is None else batch.completion_values(outs if bucketed else outs[0])
        if values is not None:
            batch = batch.with_completion_values("ref_logp", values)
        microbatches = [self.setup.num_microbatches * D if mb is None else mb for mb, *_ in specs]
        inputs = [{"input_ids": ids, "next_ids": nxt, **kw} for _, ids, nxt, kw in specs]

        def compute(i: int, k: int) -> torch.Tensor:
            return self._reference_microbatch(inputs[i], int(inputs[i]["input_ids"].shape[0]) // microbatches[i], k)

        # A plan of no fills still runs the hook: it measures the waits the next step offers.
        masks = [p.completion_mask() for p in passes] if outs is not None and plan.num_filled else None
        self._fill = StepFill(plan, microbatches, self.rank, self.layout, self.groups.pp, compute, self.timeline,
                              self.stage_ids, TARGET_FIELDS.index("ref_logp"), outs, masks, self.groups.dp)
        try:
            step = self.train_step(batch)
        finally:
            fill, self._fill = self._fill, None
        step.metrics.update(reference_seconds=reference_s, reference_fill_microbatches=float(fill.filled),
                            reference_fill_seconds=fill.fill_ns / 1e9, **self._fill_measured)
        if plan.num_filled:  # the pre-step pass's log-probs with the fills in
            outs = fill.finish()
            values = None if outs is None else batch.completion_values(outs if bucketed else outs[0])
        return step, values if self.is_output_rank else None

    @torch.no_grad()
    def _forward_logp(self, what: str, passes: list, to: str = "output") -> Optional[list[torch.Tensor]]:
        """Forward-only passes (global microbatches or None, input_ids, next_ids, stage kwargs) in
        order; their outputs on the ranks ``to`` names (:meth:`batch_logp`), None elsewhere."""
        if what == "reference_logp" and self.reference_whole is not None:
            return self._shared_logp(what, passes, to)
        call, guarded = self._begin(what)
        with guarded:
            inputs = [(mb, {"input_ids": ids, "next_ids": nxt.long(), **kw}) for mb, ids, nxt, kw in passes]
            local_passes = self._pass_inputs(call, what, inputs)
            self.forward_timeline.clear()
            outs, inferences = [], 0
            t0 = self._now_ns()
            for key, m, local in local_passes:
                schedule = self._schedule_for(what, key, m, tuple(local["input_ids"].shape))
                inferences += self._first_use(key)
                input_ids = local.pop("input_ids")
                args = (input_ids,) if self.holds_first else ()
                with timed_p2p():
                    outs.append(schedule.step(*args, **local))
            t1 = self._now_ns()
            metrics = {"bubble_fraction": bubble_fraction(self.forward_timeline.actions, t0, t1),
                       "step_seconds": (t1 - t0) / 1e9, "pipeline_shape_inferences": float(inferences),
                       **self.forward_timeline.stash_metrics()}
            self.last_forward = StepResult(self.rank, metrics, list(self.forward_timeline.actions), (t0, t1))
            if not self.holds_last:
                return None
            if self.layout.dp > 1:
                gathered = []
                for out in outs:
                    parts = [torch.empty_like(out) for _ in range(self.layout.dp)]
                    dist.all_gather(parts, out.contiguous(), group=self.groups.dp)
                    gathered.append(torch.cat(parts))
                outs = gathered
            return [o.cpu() for o in outs] if self.is_output_rank or to == "loss" else None

    def _reference_microbatch(self, full: dict[str, torch.Tensor], size: int, j: int) -> torch.Tensor:
        """Microbatch ``j`` (rows [j size, (j + 1) size)) of a pass's ``full`` inputs through the
        whole reference: its per-token log-probs [size, T], float32."""
        part = {key: v[j * size:(j + 1) * size].to(self.device) for key, v in full.items()}
        with autocast_to(self.device, self.autocast):
            return self.reference_whole(part.pop("input_ids"), **part).float()

    def _fill_offers(self, keys: list[str], inputs: list) -> np.ndarray:
        """This rank's offers for the step's passes (stages/train/fill.py ``offer``), from the
        P2P waits of each pass's last step and this rank's time for one reference microbatch."""
        offers, times, longest = [], [], 0
        for i, (key, (M, full)) in enumerate(zip(keys, inputs)):
            shape = (int(full["input_ids"].shape[0]) // M, int(full["input_ids"].shape[1]))
            waits = self._fill_waits.get(key)
            offers.append(offer(waits, M // self.layout.dp, i + 1 < len(inputs)) if waits else (0, 0, 0))
            times.append(int(self._reference_mb_ns.get(shape, 0)))
            if offers[-1][2]:
                longest = max(longest, waits[offers[-1][0]].available_ns)
        # what the plan had to go on: this rank's longest offered wait, its slowest microbatch
        self._fill_measured = {"reference_fill_wait_seconds": longest / 1e9,
                               "reference_microbatch_seconds": max(times, default=0) / 1e9}
        return encode_offers(offers, times)

    def _shared_logp(self, what: str, passes: list, to: str = "output", fill_keys: Optional[list[str]] = None):
        """reference_parallel=data: every rank runs the whole reference over its share of the
        microbatches (the k-th microbatch of the call, over all passes, goes to rank k mod world),
        then one SUM of the zero-filled outputs onto the output rank (``to`` = "loss": onto every
        rank, kept where the last stage is). Each value comes from one rank and x + 0 = x, so the
        sum is exact; a microbatch holds the rows the pipeline's microbatch holds, so each row is
        computed as there. ``fill_keys`` (the step's train schedule keys): the ranks agree on a
        :class:`~stages.train.fill.FillPlan` with the input check, compute the microbatches it
        gives them, and the call returns (outputs, plan)."""
        call, guarded = self._begin(what)
        with guarded:
            world, D = self.layout.world_size, self.layout.dp
            inputs = [(self.setup.num_microbatches * D if mb is None else mb,
                       {"input_ids": ids, "next_ids": nxt.long(), **kw}) for mb, ids, nxt, kw in passes]
            plan: Optional[FillPlan] = None
            if fill_keys is None:
                self.guard.check_inputs(call, passes_signature(inputs)[0])
            else:
                gathered = self.guard.check_inputs(call, passes_signature(inputs)[0],
                                                   extra=self._fill_offers(fill_keys, inputs))
                costs = [float(full["input_ids"].numel()) / m for m, full in inputs]
                plan = plan_fill([decode_offers(g, len(inputs)) for g in gathered], [m for m, _ in inputs], costs,
                                 self.layout)
            t0 = self._now_ns()
            outs, k, busy_ns = [], 0, 0
            for i, (m, full) in enumerate(inputs):
                rows = int(full["input_ids"].shape[0])
                if rows % m:
                    raise TrainInputError(f"{what}: a pass of {rows} rows does not split into {m} microbatches")
                size = rows // m
                out = torch.zeros(full["input_ids"].shape, dtype=torch.float32, device=self.device)
                spent, ran = 0, 0
                for j in range(m):
                    if (plan.owner[i][j] if plan is not None else (k + j) % world) == self.rank:
                        c0 = self._now_ns()
                        out[j * size:(j + 1) * size] = self._reference_microbatch(full, size, j)
                        spent += self._now_ns() - c0
                        ran += 1
                if ran:
                    self._reference_mb_ns[(size, int(full["input_ids"].shape[1]))] = spent / ran
                busy_ns += spent
                k += m
                outs.append(out)
            flat = torch.cat([o.reshape(-1) for o in outs])
            if to == "output":
                dist.reduce(flat, dst=self.output_rank, op=dist.ReduceOp.SUM)
            else:
                dist.all_reduce(flat, op=dist.ReduceOp.SUM)
            t1 = self._now_ns()
            self.last_forward = StepResult(self.rank, {"bubble_fraction": 1 - busy_ns / max(t1 - t0, 1),
                                                       "step_seconds": (t1 - t0) / 1e9}, [], (t0, t1))
            if not (self.is_output_rank or (to == "loss" and self.holds_last)):
                return None if plan is None else (None, plan)
            outs = [piece.reshape(o.shape).cpu() for piece, o in zip(torch.split(flat, [o.numel() for o in outs]), outs)]
            return outs if plan is None else (outs, plan)

    # -- weights --------------------------------------------------------------------------------------
    def _hf_tensors(self, grads: bool) -> dict[str, torch.Tensor]:
        what = "hf_grads" if grads else "hf_state"
        out = {}
        with self.guard.guarded(f"{what}-{self._passes}", what):
            for m in self.modules:
                for name, p in hf_named_parameters(m):
                    t = p.grad if grads else p
                    if t is None:
                        continue
                    t = t.full_tensor() if isinstance(t, DTensor) else t  # all-gather over TP
                    out[name] = t.detach().to(_CPU, copy=True).contiguous()
        return out

    def hf_grads(self) -> dict[str, torch.Tensor]:
        """This rank's gradients under HF names (whole tensors: TP shards are gathered)."""
        return self._hf_tensors(grads=True)

    def hf_state(self) -> dict[str, torch.Tensor]:
        """This rank's weights under HF names (whole tensors); a collective over TP."""
        return self._hf_tensors(grads=False)

    # -- optimiser state ------------------------------------------------------------------------------
    def _named_params(self) -> list[tuple[str, nn.Parameter]]:
        """This rank's trainable parameters, each once, named "<module index>.<parameter name>"."""
        seen: set[int] = set()
        out = []
        for j, m in enumerate(self.modules):
            for name, p in m.named_parameters():
                if id(p) not in seen:
                    seen.add(id(p))
                    out.append((f"{j}.{name}", p))
        return out

    def optimizer_state(self) -> dict[str, torch.Tensor]:
        """AdamW's per-parameter state of this rank (local TP shards): "<param>.exp_avg",
        "<param>.exp_avg_sq", "<param>.step"; empty before the first step. On the CPU these are
        the live tensors, not copies (a rank's state is twice its weights): save them before the
        next step moves them."""
        out: dict[str, torch.Tensor] = {}
        for name, p in self._named_params():
            for key, value in self.optimizer.state.get(p, {}).items():
                t = value.to_local() if isinstance(value, DTensor) else value
                out[f"{name}.{key}"] = t.detach().to(_CPU).contiguous()
        return out

    def load_optimizer_state(self, state: dict[str, torch.Tensor]) -> None:
        """Restore :meth:`optimizer_state` of the same rank and layout, bit for bit."""
        params = self._named_params()
        expected = {f"{n}.{k}" for n, _ in params for k in ("exp_avg", "exp_avg_sq", "step")}
        if set(state) != expected:
            missing, extra = sorted(expected - set(state))[:3], sorted(set(state) - expected)[:3]
            raise ValueError(f"optimiser state of rank {self.rank} does not match its parameters "
                             f"(missing {missing}, unexpected {extra}): was it saved with another layout?")
        for name, p in params:
            entry = {}
            for key in ("exp_avg", "exp_avg_sq", "step"):
                # The step count on the host, the moments by the parameter (fused AdamW: all by it).
                where = p.device if key != "step" or self.optimizer.defaults.get("fused") else _CPU
                t = state[f"{name}.{key}"].to(where, copy=True)
                if key != "step" and isinstance(p, DTensor):
                    t = DTensor.from_local(t, p.device_mesh, p.placements, run_check=False)
                elif key != "step" and t.shape != p.shape:
                    raise ValueError(f"optimiser state {name}.{key} of rank {self.rank} has shape "
                                     f"{tuple(t.shape)}, the parameter {tuple(p.shape)}")
                entry[key] = t
            self.optimizer.state[p] = entry

    def close(self) -> None:
        """Leave the process group (an aborted one is left to the process's exit: a peer may still
        be blocked on it)."""
        if not self.groups.owns_world:
            return
        self.guard.close(owner=self.rank == 0, timeout_s=self.setup.timeout_s)
        if dist.is_initialized() and not self.guard.aborted:
            dist.destroy_process_group()


def _pass_key(what: str, global_microbatches: Optional[int], m: int, input_ids: str) -> str:
    """The schedule key of a pass: ``what`` for the run's fixed layout (``global_microbatches``
    None), else one per (m per data-parallel rank, the input_ids signature)."""
    return what if global_microbatches is None else f"{what}[{m}x{input_ids}]"


def rank_tensor_names(model: DecoderConfig, layout: ParallelLayout, pp_rank: int,
                      layer_split: Optional[tuple[int, ...]] = None) -> set[str]:
    """The HF tensor names pipeline rank ``pp_rank`` needs under ``layer_split`` (TrainSetup's;
    None: the even split), without building its weights."""
    names: set[str] = set()
    with torch.device("meta"):
        for s in layout.stages_of(pp_rank):
            names |= set(stage_hf_names(build_stage(model, s, layout.num_stages, layer_split=layer_split)))
    return names
