"""One pipeline-parallel training rank: its stage of the policy, a frozen reference stage, the
schedule and the optimiser, kept alive across iterations.

The engine is plain torch: flows/ places one per Dask worker (``train`` resource) and calls
:meth:`TrainRank.train_step` / :meth:`TrainRank.reference_logp` once per iteration on every rank.
Gradients are exact: the schedule does not rescale them (``scale_grads=False``) and each
microbatch's loss is a partial sum weighted by global-batch denominators (stages/train/loss.py).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

from stages.policy import (DecoderConfig, build_stage, hf_named_parameters, hf_state, load_hf_state,
                           stage_hf_names)
from stages.train.batch import GlobalBatch
from stages.train.loss import LossConfig, LossStats, grpo_microbatch_loss, token_logp
from stages.train.timeline import Action, TimedStage, bubble_fraction

__all__ = ["TrainSetup", "StepResult", "TrainRank", "SCHEDULE_CLASSES"]

SCHEDULE_CLASSES = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}


@dataclass(frozen=True)
class TrainSetup:
    model: DecoderConfig
    num_stages: int
    num_microbatches: int
    schedule: str = "1f1b"
    lr: float = 1e-3
    weight_decay: float = 0.0
    max_grad_norm: float = 1.0
    loss: LossConfig = field(default_factory=LossConfig)
    timeout_s: float = 120.0


@dataclass
class StepResult:
    rank: int
    metrics: dict[str, float]
    actions: list[Action]
    window_ns: tuple[int, int]


class _RefLogpStage(nn.Module):
    """Forward-only wrapper: carries the next-token ids along the pipeline so the last stage
    returns per-token log-probs [B, T] instead of logits."""

    def __init__(self, stage: nn.Module, temperature: float):
        super().__init__()
        self.stage, self.temperature = stage, temperature

    def forward(self, x: torch.Tensor, next_ids: torch.Tensor):
        h = self.stage(x)
        if self.stage.is_last:
            return token_logp(h, next_ids, self.temperature)
        return h, next_ids


class TrainRank:
    def __init__(self, setup: TrainSetup, rank: int, init_method: str, tensors: dict[str, torch.Tensor]):
        self.setup, self.rank = setup, rank
        self.timeout = timedelta(seconds=setup.timeout_s)
        if not dist.is_initialized():
            dist.init_process_group("gloo", init_method=init_method, rank=rank,
                                    world_size=setup.num_stages, timeout=self.timeout)
        self.device = torch.device("cpu")
        p = setup.num_stages
        self.module = build_stage(setup.model, rank, p)
        load_hf_state(self.module, tensors)
        self.reference = build_stage(setup.model, rank, p)
        load_hf_state(self.reference, tensors)
        self.reference.requires_grad_(False)
        # Tied embeddings split across stages: the first and last stage each hold a copy, and
        # their gradients are summed so both copies take the same update.
        self.tied_group = None
        if setup.model.tie_word_embeddings and p > 1:
            self.tied_group = dist.new_group([0, p - 1], timeout=self.timeout)
        self.stage = TimedStage(self.module, rank, p, self.device)
        schedule_cls = SCHEDULE_CLASSES[setup.schedule]
        self.schedule = schedule_cls(self.stage, setup.num_microbatches, loss_fn=self._loss,
                                     scale_grads=False)
        self.ref_stage = PipelineStage(_RefLogpStage(self.reference, setup.loss.temperature), rank, p,
                                       self.device)
        self.ref_schedule = ScheduleGPipe(self.ref_stage, setup.num_microbatches)
        self.optimizer = torch.optim.AdamW(self.module.parameters(), lr=setup.lr,
                                           weight_decay=setup.weight_decay)
        self._stats: list[LossStats] = []
        self.steps_done = 0

    # -- the loss on the last stage ----------------------------------------------------------------
    def _loss(self, logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        loss, stats = grpo_microbatch_loss(logits, target, self.setup.loss)
        self._stats.append(stats)
        return loss

    # -- one optimiser step --------------------------------------------------------------------------
    def train_step(self, batch: GlobalBatch) -> StepResult:
        """Run the schedule over the global batch and take one optimiser step."""
        result = self.forward_backward(batch)
        result.metrics["grad_norm"] = self._clip_grads()
        self.optimizer.step()
        self.steps_done += 1
        return result

    def forward_backward(self, batch: GlobalBatch) -> StepResult:
        """Gradients of the global-batch loss in ``.grad`` of this rank's parameters."""
        self.optimizer.zero_grad(set_to_none=True)
        self._stats.clear()
        self.stage.actions = []
        dist.barrier()  # a common start, so every rank's window measures the same step
        t0 = time.time_ns()
        if self.stage.is_first:
            self.schedule.step(batch.input_ids)
        elif self.stage.is_last:
            self.schedule.step(target=batch.target)
        else:
            self.schedule.step()
        t1 = time.time_ns()
        self._reduce_tied_grads()
        metrics: dict[str, float] = {}
        # The first step runs the loss once more for shape inference: keep the real microbatches.
        real = self._stats[-self.setup.num_microbatches:] if self.stage.is_last else []
        if real:
            total = LossStats()
            for s in real:
                total.add(s)
            metrics.update(total.metrics())
        metrics["bubble_fraction"] = bubble_fraction(self.stage.actions, t0, t1)
        metrics["step_seconds"] = (t1 - t0) / 1e9
        return StepResult(self.rank, metrics, list(self.stage.actions), (t0, t1))

    def hf_grads(self) -> dict[str, torch.Tensor]:
        """This rank's gradients under HF names."""
        return {name: p.grad.detach().clone() for name, p in hf_named_parameters(self.module)
                if p.grad is not None}

    def _reduce_tied_grads(self) -> None:
        if self.tied_group is None or not (self.stage.is_first or self.stage.is_last):
            return
        w = self.module.embed_tokens.weight if self.stage.is_first else self.module.lm_head.weight
        if w.grad is None:
            w.grad = torch.zeros_like(w)
        dist.all_reduce(w.grad, group=self.tied_group)

    def _clip_grads(self) -> float:
        """Clip by the global norm over every stage (each rank holds a disjoint set of weights)."""
        params = [p for p in self.module.parameters() if p.grad is not None]
        local = torch.stack([p.grad.pow(2).sum() for p in params]).sum() if params else torch.zeros(())
        # A tied weight lives on two ranks with the same gradient: count it once.
        if self.tied_group is not None and self.stage.is_last:
            local = local - self.module.lm_head.weight.grad.pow(2).sum()
        dist.all_reduce(local)
        norm = float(local.sqrt())
        if self.setup.max_grad_norm > 0 and norm > self.setup.max_grad_norm:
            scale = self.setup.max_grad_norm / (norm + 1e-6)
            for p in params:
                p.grad.mul_(scale)
        return norm

    # -- forward-only passes ------------------------------------------------------------------------
    @torch.no_grad()
    def reference_logp(self, input_ids: torch.Tensor, next_ids: torch.Tensor) -> torch.Tensor | None:
        """Per-token log-probs of the frozen reference; returned on the last stage, None elsewhere."""
        if self.stage.is_first:
            return self.ref_schedule.step(input_ids, next_ids)
        return self.ref_schedule.step()

    def hf_state(self) -> dict[str, torch.Tensor]:
        return hf_state(self.module)

    def close(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()


def stage_tensor_names(model: DecoderConfig, rank: int, num_stages: int) -> set[str]:
    """The HF tensor names stage ``rank`` needs, without building its weights twice."""
    with torch.device("meta"):
        return set(stage_hf_names(build_stage(model, rank, num_stages)))


__all__.append("stage_tensor_names")
